"""DeepEP's `Config`, its per-rank-count tables and size hints, for code written against
`deep_ep`.

weft's kernels take no chunk sizes (one fused kernel per call moves every row straight to its
final index), so of a Config only `num_sms` is used: the most SMs (one block each) a call may
occupy, a cap (a call of few tokens takes fewer blocks); 0 = every SM of the device. DeepEP's
rules on the chunk sizes are checked all the same, so that a Config that DeepEP refuses is
refused here too.
"""

from __future__ import annotations

from .. import Error
from .sizing import window_bytes_for

# DeepEP V1's recommended intranode configs: num_ranks -> (nvl_send, nvl_recv, rdma_send,
# rdma_recv) chunk sizes of dispatch and of combine. Other rank counts are refused, as in
# DeepEP; weft adds one rank (every expert local: one GPU).
_DISPATCH = {1: (24, 256, 6, 128), 2: (24, 256, 6, 128), 4: (6, 256, 6, 128),
             8: (6, 256, 6, 128)}
_COMBINE = {1: (10, 256, 6, 128), 2: (10, 256, 6, 128), 4: (9, 256, 6, 128),
            8: (4, 256, 6, 128)}


def _int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Error(f"Config: {name} must be an int, got {value!r}")
    return value


class Config:
    """DeepEP's performance config: Config(num_sms, nvl_send_chunk, nvl_recv_chunk,
    rdma_send_chunk=6, rdma_recv_chunk=256), with DeepEP's checks. weft uses num_sms; the chunk
    sizes are kept for code that reads them back."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        num_sms = _int("num_sms", num_sms)
        nvl_send = _int("num_max_nvl_chunked_send_tokens", num_max_nvl_chunked_send_tokens)
        nvl_recv = _int("num_max_nvl_chunked_recv_tokens", num_max_nvl_chunked_recv_tokens)
        rdma_send = _int("num_max_rdma_chunked_send_tokens", num_max_rdma_chunked_send_tokens)
        rdma_recv = _int("num_max_rdma_chunked_recv_tokens", num_max_rdma_chunked_recv_tokens)
        if num_sms < 0:
            raise Error(f"Config: num_sms must be >= 0, got {num_sms}")
        if not 0 < nvl_send < nvl_recv:
            raise Error(f"Config: the NVLink chunk sizes need 0 < send ({nvl_send}) < "
                        f"receive ({nvl_recv})")
        if rdma_send <= 0 or rdma_recv <= 0:
            raise Error(f"Config: the RDMA chunk sizes must be positive, got {rdma_send}, "
                        f"{rdma_recv}")
        rdma_recv = -(-rdma_recv // rdma_send) * rdma_send  # DeepEP rounds it up
        if not rdma_send <= rdma_recv // 2:
            raise Error(f"Config: the RDMA send chunk ({rdma_send}) must be at most half the "
                        f"receive chunk ({rdma_recv})")
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = nvl_send
        self.num_max_nvl_chunked_recv_tokens = nvl_recv
        self.num_max_rdma_chunked_send_tokens = rdma_send
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int,
                                 num_tokens: int = 4096) -> int:
        """Bytes of weft's first window for num_tokens tokens per rank of hidden_bytes each at
        num_ranks ranks and top-8 routing. A window grows when a dispatch sends more tokens
        (Buffer.num_regrowths), so the hint need not cover the largest T."""
        return window_bytes_for(num_tokens, hidden_bytes // 2, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: weft.ep is intranode only (no RDMA buffer)."""
        return 0

    def __repr__(self) -> str:
        return (f"weft.ep.Config(num_sms={self.num_sms}, "
                f"nvl_chunks=({self.num_max_nvl_chunked_send_tokens}, "
                f"{self.num_max_nvl_chunked_recv_tokens}))")


def _config(table: dict, num_sms: int, num_ranks: int, what: str) -> Config:
    if num_ranks not in table:
        raise Error(f"{what}: unsupported number of EP ranks {num_ranks} (weft.ep, like "
                    f"DeepEP's intranode mode, runs {', '.join(map(str, sorted(table)))} ranks)")
    return Config(num_sms, *table[num_ranks])


def dispatch_config(num_sms: int, num_ranks: int) -> Config:
    """DeepEP's get_dispatch_config(num_ranks) with Buffer.num_sms."""
    return _config(_DISPATCH, num_sms, num_ranks, "get_dispatch_config")


def combine_config(num_sms: int, num_ranks: int) -> Config:
    """DeepEP's get_combine_config(num_ranks) with Buffer.num_sms."""
    return _config(_COMBINE, num_sms, num_ranks, "get_combine_config")
