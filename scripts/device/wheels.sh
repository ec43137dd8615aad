# Source this on the offline GPU machine (bash): installs the optional wheels that were carried in `.whl/`
# into /tmp/site and puts them on PYTHONPATH, together with this checkout's three packages.
#
# flash-attn-4 needs nvidia-cutlass-dsl-libs-cu13 (~92 MB), too large to travel with the other wheels in one
# call (64 MiB per call, the working tree included). Carry it first, in parts of the unpacked wheel
# (`.cu13/cu13.KofN.tar.xz`, each `tar cf - FILES | xz -9`; 2 parts: 13 and ~50 MiB), one part per call, the calls
# back to back while the machine stays warm (carry names the part's path): this script unpacks each part it finds
# to /tmp/cu13site, which stays while the machine does. The cu13 libs count as present once all N parts are
# there; a later call carrying `.whl/` then installs the rest and lays the cu13 files over them (pip --target
# --upgrade would replace the shared `nvidia_cutlass_dsl/` folder, so the order matters).
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
for part in "$ROOT"/.cu13/cu13.*of*.tar.xz; do
  [ -f "$part" ] || continue
  name=$(basename "$part" .tar.xz)
  [ -f "/tmp/cu13parts/$name" ] && continue
  mkdir -p /tmp/cu13site /tmp/cu13parts && xz -dc "$part" | tar xf - -C /tmp/cu13site && touch "/tmp/cu13parts/$name" \
    && echo "[wheels] cu13 libs: $name unpacked"
done
cu13_complete() {  # all N parts of the cu13 libs unpacked
  local marker total
  marker=$(ls /tmp/cu13parts 2>/dev/null | head -n 1)
  [ -n "$marker" ] || return 1
  total=${marker##*of}
  [ "$(ls /tmp/cu13parts | wc -l)" -eq "$total" ]
}
# Without the cu13 libs, nvidia-cutlass-dsl is half installed and raises at import, and torchao (which probes it)
# would fail too: then flash-attn-4 and its DSL wheels are left out (the fa4 backend reports itself unavailable).
wheels=()
for w in "$ROOT"/.whl/*.whl; do
  [ -f "$w" ] || continue
  case "$(basename "$w")" in
    nvidia_cutlass_dsl*|flash_attn_4*|quack_kernels*) cu13_complete || continue ;;
  esac
  wheels+=("$w")
done
if [ "${#wheels[@]}" -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" \
    && echo "[wheels] installed: $(for w in "${wheels[@]}"; do basename "$w" | sed 's/-[0-9].*//'; done | tr '\n' ' ')"
fi
if cu13_complete && [ -d /tmp/site ]; then cp -a /tmp/cu13site/. /tmp/site/; fi
export PYTHONPATH="$ROOT:$ROOT/activations:$ROOT/optimizer${PYTHONPATH:+:$PYTHONPATH}"
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
export PYTHONUNBUFFERED=1
