"""The scheduler's consistency checks (`debug_invariants`: after every step)."""

from __future__ import annotations

from aserve.core.kv_cache_manager import InvariantError
from aserve.core.request import RequestStatus


def check_queues(scheduler) -> None:
    """Raises InvariantError unless the queues hold each live request exactly once, with a status matching its
    queue, and the KV manager's invariants hold for them."""
    live = list(scheduler.running) + list(scheduler.waiting)
    ids = [r.request_id for r in live]
    if len(set(ids)) != len(ids):
        raise InvariantError(
            f"a request is queued twice: running {scheduler.running}, waiting {list(scheduler.waiting)}"
        )
    if set(ids) != set(scheduler.requests) or any(scheduler.requests[r.request_id] is not r for r in live):
        raise InvariantError(f"the queues ({sorted(ids)}) and the live requests ({sorted(scheduler.requests)}) differ")
    for r in scheduler.running:
        if r.status != RequestStatus.RUNNING:
            raise InvariantError(f"{r} is in the running queue")
    for r in scheduler.waiting:
        if r.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            raise InvariantError(f"{r} is in the waiting queue")
        if r.status == RequestStatus.PREEMPTED and r.num_computed_tokens != 0:
            raise InvariantError(f"{r} was preempted but counts computed tokens")
    if len(scheduler.running) > scheduler.max_num_seqs:
        raise InvariantError(
            f"{len(scheduler.running)} requests running, more than max_num_seqs {scheduler.max_num_seqs}"
        )
    scheduler.kv.check_invariants(live)
