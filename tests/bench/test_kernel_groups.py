"""bench/kernel_groups.py: kernel-name classification and optimizer-range attribution of a profile."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "kernel_groups.py"
_spec = importlib.util.spec_from_file_location("kernel_groups", _PATH)
kernel_groups = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_groups)


@pytest.mark.parametrize(
    "name, group",
    [
        ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "bf16 GEMM"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "bf16 GEMM"),
        ("sm90_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x32", "fp32 GEMM (FFMA)"),
        ("ampere_sgemm_128x64_nn", "fp32 GEMM (FFMA)"),
        ("sm80_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32", "tf32 GEMM"),
        ("void cutlass::device_kernel<at::cuda::detail::enable_3x_kernel_for_sm9x<GroupProblemShape>>", "grouped GEMM"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128", "attention"),
        ("triton_tem_fused_flex_attention_backward_0", "attention"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "communication"),
        ("void at::native::elementwise_kernel<128, 4, at::native::direct_copy_kernel_cuda>", "copies/casts"),
        ("triton_poi_fused__to_copy_12", "copies/casts"),
        ("Memcpy DtoD (Device -> Device)", "copies/casts"),
        ("triton_red_fused_rms_norm_3", "norms"),
        ("polynorm_fwd_kernel", "norms"),
        ("triton_poi_fused_add_mul_sigmoid_7", "elementwise/fused"),
        # a compiled fusion that merely contains a transpose is math, not a copy
        ("triton_poi_fused__to_copy_add_addcmul_clamp_div_sigmoid_stack_sum_transpose_view_49", "elementwise/fused"),
        ("void at::native::batched_transpose_kernel<float>", "copies/casts"),
    ],
)
def test_classify_kernel(name, group):
    assert kernel_groups.classify_kernel(name) == group


def _evt(name, start, end, annotation=False, device="DeviceType.CUDA"):
    return SimpleNamespace(
        name=name, device_type=device, is_user_annotation=annotation, time_range=SimpleNamespace(start=start, end=end)
    )


def test_optimizer_range_claims_its_kernels_and_shares_sum_to_one():
    events = [
        _evt("aten::mm", 0, 5, device="DeviceType.CPU"),  # CPU op: ignored
        _evt("nvjet_tst_fwd", 0, 4000),  # 4 ms bf16 GEMM outside the optimizer
        _evt("triton_poi_fused__to_copy_1", 4000, 5000),  # 1 ms cast
        _evt("Optimizer.step#Muon.step", 5000, 9000, annotation=True),
        _evt("nvjet_tst_newton_schulz", 5100, 8000),  # inside Muon: charged to Muon, not to bf16 GEMM
        _evt("triton_poi_fused_add_1", 8000, 9000),
    ]
    rows = {g: (ms, share) for g, ms, share in kernel_groups.group_kernels(events)}
    assert rows["bf16 GEMM"][0] == pytest.approx(4.0)
    assert rows["copies/casts"][0] == pytest.approx(1.0)
    assert rows["optimizer: Muon"][0] == pytest.approx(3.9)
    assert "elementwise/fused" not in rows  # the add ran inside the Muon range
    assert sum(s for _, s in rows.values()) == pytest.approx(1.0)
    table = kernel_groups.format_groups(kernel_groups.group_kernels(events), steps=2)
    bf16_line = next(line for line in table.splitlines() if line.startswith("bf16 GEMM"))
    assert bf16_line.split()[2] == "2.0"  # 4 ms over 2 steps


def test_top_kernels_sums_launches_by_name_largest_first():
    events = [
        _evt("triton_red_fused_mul_sum_3", 0, 3000),
        _evt("nvjet_tst_fwd", 3000, 5000),
        _evt("triton_red_fused_mul_sum_3", 5000, 7000),  # second launch of the same kernel
        _evt("Optimizer.step#Muon.step", 7000, 9000, annotation=True),
        _evt("triton_poi_fused_add_1", 7000, 8000),  # inside Muon
    ]
    top = kernel_groups.top_kernels(events, n=2)
    assert top == [
        ("elementwise/fused", "triton_red_fused_mul_sum_3", pytest.approx(5.0), 2),
        ("bf16 GEMM", "nvjet_tst_fwd", pytest.approx(2.0), 1),
    ]
    assert kernel_groups.top_kernels(events, n=10)[-1] == ("optimizer: Muon", "triton_poi_fused_add_1", 1.0, 1)
