# Sourced (bash) by the GPU-machine scripts: the NCCL that the machine's PyTorch ships, for the
# build and for the programs that link it (the device API needs the library and the headers to
# be the same version). Keeps a NCCL_ROOT given by the caller. Returns non-zero when there is no
# NCCL with nccl_device.h; exports NCCL_ROOT, LD_LIBRARY_PATH and NCCL_NVLS_ENABLE=0 otherwise.
if [[ -z "${NCCL_ROOT:-}" ]]; then
  NCCL_ROOT=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
fi
if [[ -n "$NCCL_ROOT" && -f "$NCCL_ROOT/include/nccl_device.h" ]]; then
  export NCCL_ROOT
  export LD_LIBRARY_PATH="$NCCL_ROOT/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export NCCL_NVLS_ENABLE=0  # never NVLink multicast on shared machines
  true
else
  false
fi
