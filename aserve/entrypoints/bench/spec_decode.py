"""`aserve bench serve`'s Speculative Decoding block, as vLLM's: the server's speculative-decoding counters
(/metrics, `aserve:` or `vllm:` names) scraped before and after the measured run; where drafts were verified in
between, the acceptance over the run printed and saved (spec_decode_* fields)."""

from __future__ import annotations

from loadgen.server_metrics import MetricsSnapshot, server_delta

_BY_POSITION = ("spec_decode_num_accepted_tokens_per_pos_total",)


def spec_decode_fields(before: MetricsSnapshot | None, after: MetricsSnapshot | None) -> dict:
    """The run's spec_decode_* result fields (vLLM's keys: the acceptance rate in percent, the acceptance length
    1 + accepted / drafts, each draft position's accepted share of the drafts), or {} where the server verified no
    draft during the run (or has no such counters). The counters' deltas are loadgen's (server_delta)."""
    if before is None or after is None:
        return {}
    stats = server_delta(before, after, [])
    drafts = int(stats.spec_decode_drafts or 0)
    if drafts <= 0:
        return {}
    start, end = before.by_label(_BY_POSITION, "position"), after.by_label(_BY_POSITION, "position")
    positions = sorted(int(p) for p in end if p.isdigit())
    per_position = [0.0] * (positions[-1] + 1 if positions else 0)
    for p in positions:
        per_position[p] = (end[str(p)] - start.get(str(p), 0.0)) / drafts
    return {
        "spec_decode_acceptance_rate": 100.0 * (stats.spec_decode_acceptance_rate or 0.0),
        "spec_decode_acceptance_length": stats.spec_decode_mean_acceptance_length,
        "spec_decode_num_drafts": drafts,
        "spec_decode_draft_tokens": int(stats.spec_decode_draft_tokens or 0),
        "spec_decode_accepted_tokens": int(stats.spec_decode_accepted_tokens or 0),
        "spec_decode_per_position_acceptance_rates": per_position,
    }


def spec_decode_lines(fields: dict) -> list[str]:
    """The printed block for spec_decode_fields' answer (none for {})."""
    if not fields:
        return []
    lines = [
        "{s:{c}^{n}}".format(s="Speculative Decoding", n=50, c="-"),
        "{:<40} {:<10.2f}".format("Acceptance rate (%):", fields["spec_decode_acceptance_rate"]),
        "{:<40} {:<10.2f}".format("Acceptance length:", fields["spec_decode_acceptance_length"]),
        "{:<40} {:<10}".format("Drafts:", fields["spec_decode_num_drafts"]),
        "{:<40} {:<10}".format("Draft tokens:", fields["spec_decode_draft_tokens"]),
        "{:<40} {:<10}".format("Accepted tokens:", fields["spec_decode_accepted_tokens"]),
        "Per-position acceptance (%):",
    ]
    for i, rate in enumerate(fields["spec_decode_per_position_acceptance_rates"]):
        lines.append("{:<40} {:<10.2f}".format(f"  Position {i}:", 100.0 * rate))
    return lines
