"""loadgen: a traffic simulator for OpenAI-compatible servers (aserve, vLLM, ...).

`loadgen --url http://127.0.0.1:8000 --rate 4 --num-requests 100 --slo ttft_ms=500,tpot_ms=50 --out run.json`
measures TTFT/TPOT/ITL/E2E, throughput and SLO goodput, the server's own /metrics deltas, and writes a JSON file and a
self-contained HTML report. `loadgen compare A.json B.json` prints what changed between two runs.
"""

from loadgen.config import RunConfig

__all__ = ["RunConfig"]
