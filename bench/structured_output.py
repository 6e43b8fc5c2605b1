"""Structured output's cost per decode step (CPU by default): TPOT of a batch of `--batch` sequences decoding under a
JSON schema vs the same batch unconstrained, on the embedded SmolLM2 (or --model).

    python bench/structured_output.py [--batch 32] [--max-tokens 64] [--temperatures 0,0.8] [--model PATH]
                                      [--device cpu|cuda] [--load-format dummy]

Offline engine, one batch per run: every sequence runs exactly --max-tokens tokens (the unconstrained ones ignore
EOS; the schema asks for more JSON than that, so none ends early), so the two runs have the same steps. TPOT is the
time per token of each sequence while the whole batch decodes (the prefill steps are left out); the overhead is
json_schema's TPOT over the unconstrained one. The grammar is compiled before the clock starts (a cached schema, as
a server sees it after its first request). Prints a table.
"""

from __future__ import annotations

import argparse
import time

from aserve import LLMEngine, SamplingParams, StructuredOutputsParams
from aserve.config import EngineArgs
from aserve.sampling_params import RequestOutputKind

# A long bounded JSON document: at least 12 objects of several fields, far more than --max-tokens tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "products": {
            "type": "array",
            "minItems": 12,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 8, "maxLength": 40},
                    "category": {"enum": ["food", "tools", "toys", "books", "clothes"]},
                    "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    "in_stock": {"type": "boolean"},
                    "tags": {
                        "type": "array",
                        "items": {"type": "string", "maxLength": 12},
                        "minItems": 2,
                        "maxItems": 4,
                    },
                },
                "required": ["name", "category", "price", "in_stock", "tags"],
            },
        }
    },
    "required": ["products"],
}
TOPICS = ["a grocery store", "a hardware shop", "a toy shop", "a bookshop", "a clothes shop", "a bakery",
          "a garden centre", "a pharmacy"]  # fmt: skip


def prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    tokenizer = engine.tokenizer
    out = []
    for i in range(n):
        text = f"List the products of {TOPICS[i % len(TOPICS)]} (number {i}) as JSON."
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)  # fmt: skip
        out.append(tokenizer.encode(rendered, add_special_tokens=False))
    return out


def run(engine: LLMEngine, batch: list[list[int]], params: SamplingParams, tag: str) -> dict:
    """-> the decode phase (every sequence running, its prompt computed): wall and process CPU seconds per token of
    each sequence. Per token, not per step: with async scheduling a step may only wait for the one in flight."""
    grammar = engine.grammar_future(params)
    if grammar is not None:
        grammar.result()
    for i, ids in enumerate(batch):
        engine.add_request(f"{tag}-{i}", {"prompt_token_ids": ids}, params, output_kind=RequestOutputKind.FINAL_ONLY)
    wall, cpu, decode_tokens, finishes = 0.0, 0.0, 0, []
    scheduler = engine.core.scheduler
    while engine.has_unfinished_requests():
        decoding = len(scheduler.running) == len(batch) and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running
        )
        t0, c0 = time.perf_counter(), time.process_time()
        outputs = engine.step()
        if decoding:
            wall += time.perf_counter() - t0
            cpu += time.process_time() - c0
            decode_tokens += sum(len(c.token_ids) for out in outputs for c in out.outputs)
        finishes += [c.finish_reason for out in outputs for c in out.outputs if c.finish_reason]
    per_sequence = max(decode_tokens / len(batch), 1e-9)
    return {"tokens": per_sequence, "tpot": wall / per_sequence, "cpu": cpu / per_sequence, "finishes": finishes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperatures", default="0,0.8")
    p.add_argument("--device", default="cpu")
    p.add_argument("--load-format", default="auto", help="dummy: random weights (a model directory without them)")
    args = p.parse_args()
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, max_num_seqs=args.batch, max_model_len=2048,
                                  load_format=args.load_format))  # fmt: skip
    batch = prompts(engine, args.batch)
    constraint = StructuredOutputsParams(json=SCHEMA)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    run(engine, batch[:4], warm, "warmup")
    run(engine, batch[:4], warm.clone(structured_outputs=constraint), "warmup-json")
    rows = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        base = SamplingParams(temperature=temperature, seed=0, max_tokens=args.max_tokens)
        free = run(engine, batch, base.clone(ignore_eos=True), f"free-{temperature}")
        constrained = run(engine, batch, base.clone(structured_outputs=constraint), f"json-{temperature}")
        for mode, r in (("unconstrained", free), ("json_schema", constrained)):
            assert set(r["finishes"]) == {"length"}, f"{mode}: a sequence ended early ({set(r['finishes'])})"
        rows.append((temperature, free, constrained))
    print(f"\n{args.batch} sequences x {args.max_tokens} tokens, {engine.config.served_model_name} on {args.device}")
    # CPU seconds (all the process's threads) beside the wall time: on a shared machine, the less noisy.
    print("| temperature | mode | decode tokens / sequence | TPOT (ms) | overhead | CPU ms / token | overhead |")
    print("|---|---|---|---|---|---|---|")
    for temperature, free, constrained in rows:
        for mode, r in (("unconstrained", free), ("json_schema", constrained)):
            over = "" if r is free else f"{100 * (r['tpot'] / free['tpot'] - 1):+.1f} %"
            over_cpu = "" if r is free else f"{100 * (r['cpu'] / free['cpu'] - 1):+.1f} %"
            print(f"| {temperature:g} | {mode} | {r['tokens']:.0f} | {1e3 * r['tpot']:.2f} | {over} | "
                  f"{1e3 * r['cpu']:.2f} | {over_cpu} |")  # fmt: skip


if __name__ == "__main__":
    main()
