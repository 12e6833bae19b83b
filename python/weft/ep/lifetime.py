"""Releasing weft.ep's device resources at interpreter exit.

Buffers and communicators still alive when the interpreter exits (module globals, a model that
holds its layer's Buffer) are destroyed by an atexit hook, windows before their communicators:
each waits for the work queued on its device, then frees its window, deregisters it and destroys
its NCCL communicator, and drops its reference to the extension's object, so that nothing of
weft's is left for the interpreter's teardown. The hook runs before torch's own exit handlers
(atexit runs in reverse order of registration, and weft.ep imports torch first).
"""

from __future__ import annotations

import atexit
import weakref

_buffers: "weakref.WeakSet" = weakref.WeakSet()
_communicators: "weakref.WeakSet" = weakref.WeakSet()


def track_buffer(buffer) -> None:
    """Releases buffer (a NativeBuffer) at exit if it is still alive then."""
    _buffers.add(buffer)


def track_communicator(communicator) -> None:
    """Releases communicator (a Communicator) at exit, after every Buffer."""
    _communicators.add(communicator)


def release_all() -> None:
    for buf in list(_buffers):
        buf._release_at_exit()
    for comm in list(_communicators):
        native, comm.native = comm.native, None
        if native is not None and native.alive:
            native.destroy()


atexit.register(release_all)
