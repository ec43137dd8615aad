"""llm_training/autograd_output.py: a Function's output is a tensor of its own (the cast, or a copy). The torch 2.11
compile bug it avoids is caught by tests/distributed/test_compile.py (compiled vs eager gradients of the model) and
activations/tests/test_reference.py (the fused ops under fullgraph compile) when they run on torch 2.11."""

import torch

from llm_training.autograd_output import function_output


def test_function_output_casts_or_copies():
    t = torch.randn(4, 3)
    same = function_output(t, torch.float32)
    assert same.dtype == torch.float32 and same.data_ptr() != t.data_ptr()
    torch.testing.assert_close(same, t)
    low = function_output(t, torch.bfloat16)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low, t.bfloat16())
