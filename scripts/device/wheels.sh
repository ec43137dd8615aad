# Source this on the offline GPU machine (bash): installs the optional wheels that were carried in `.whl/`
# into /tmp/site and puts them on PYTHONPATH, together with this checkout's three packages.
#
# flash-attn-4 needs nvidia-cutlass-dsl-libs-cu13 (~92 MB), too large to travel with the other wheels in one
# call (64 MiB per call). Carry it first as `.cu13/cu13.tar.xz` (the unpacked wheel, `tar cf - . | xz -9`,
# ~61 MiB): this script unpacks it to /tmp/cu13site, which stays while the machine stays warm; a later call
# carrying `.whl/` then installs the rest and lays the cu13 files over them (pip --target --upgrade would
# replace the shared `nvidia_cutlass_dsl/` folder, so the order matters).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -f "$ROOT/.cu13/cu13.tar.xz" ] && [ ! -d /tmp/cu13site ]; then
  mkdir -p /tmp/cu13site && xz -dc "$ROOT/.cu13/cu13.tar.xz" | tar xf - -C /tmp/cu13site && echo "[wheels] cu13 libs unpacked"
fi
# Without the cu13 libs, nvidia-cutlass-dsl is half installed and raises at import, and torchao (which probes it)
# would fail too: then flash-attn-4 and its DSL wheels are left out (the fa4 backend reports itself unavailable).
wheels=()
for w in "$ROOT"/.whl/*.whl; do
  [ -f "$w" ] || continue
  case "$(basename "$w")" in
    nvidia_cutlass_dsl*|flash_attn_4*|quack_kernels*) [ -d /tmp/cu13site ] || continue ;;
  esac
  wheels+=("$w")
done
if [ "${#wheels[@]}" -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
    && echo "[wheels] installed: $(for w in "${wheels[@]}"; do basename "$w" | sed 's/-[0-9].*//'; done | tr '\n' ' ')"
fi
if [ -d /tmp/cu13site ] && [ -d /tmp/site ]; then cp -a /tmp/cu13site/. /tmp/site/; fi
export PYTHONPATH="$ROOT:$ROOT/activations:$ROOT/optimizer${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1
