"""DeepEP's `Config` and size hints, for code written against `deep_ep`.

weft's kernels take no chunk sizes (one fused kernel per call moves every row straight to its
final index), so of a Config only `num_sms` is used: the most SMs the call may occupy.
"""

from __future__ import annotations

from .. import Error
from .sizing import window_bytes_for


class Config:
    """DeepEP's performance config: Config(num_sms, nvl_send_chunk, nvl_recv_chunk,
    rdma_send_chunk=6, rdma_recv_chunk=256). weft uses num_sms; the chunk sizes are kept for
    code that reads them back."""

    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        if num_sms <= 0:
            raise Error(f"Config: num_sms must be positive, got {num_sms}")
        self.num_sms = int(num_sms)
        self.num_max_nvl_chunked_send_tokens = int(num_max_nvl_chunked_send_tokens)
        self.num_max_nvl_chunked_recv_tokens = int(num_max_nvl_chunked_recv_tokens)
        self.num_max_rdma_chunked_send_tokens = int(num_max_rdma_chunked_send_tokens)
        self.num_max_rdma_chunked_recv_tokens = int(num_max_rdma_chunked_recv_tokens)

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int,
                                 num_tokens: int = 4096) -> int:
        """Bytes of weft's window for num_tokens tokens per rank of hidden_bytes each at
        num_ranks ranks and top-8 routing (weft's window grows with the tokens per call, unlike
        DeepEP's ring buffers; pass your largest T)."""
        return window_bytes_for(num_tokens, hidden_bytes // 2, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """0: weft.ep is intranode only (no RDMA buffer)."""
        return 0

    def __repr__(self) -> str:
        return f"weft.ep.Config(num_sms={self.num_sms})"
