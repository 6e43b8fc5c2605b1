"""The host's Python work per engine step at N running sequences, in the pieces the server's event loop runs between
two launches: the scheduler's schedule and update, the output processor, and a streaming response's events written
to its socket. On a GPU this work must fit under a decode step (at 256 streams on the H200, ~15 ms) or the device
waits for it; measured here on the CPU, where it is the same Python.

    python bench/host_path.py [--model PATH] [--seqs 256] [--input-len 32] [--output-len 128]

Engine: `LLM.generate` of --seqs token-id prompts (ignore_eos, temperature 0) after a short warm-up, with the
scheduler's `schedule` / `update_from_output` and the output processor's `process` timed by wrappers: milliseconds per
step (every step has --seqs sequences once their prompts are in). Streams: --seqs requests in an OutputProcessor
(DELTA outputs, as the server's streams take them) and as many EventStreams writing to socketpairs under uvloop, fed
one token per sequence per step for --output-len steps: microseconds per sequence per step for `process` and for
EventStream.put (the chunk's bytes built and written). The model is a tiny random Llama (tests/tiny_models.py, "gqa")
unless --model names one. Prints a table last.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import socket
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def engine_costs(model: str, seqs: int, input_len: int, output_len: int):
    """-> (ms per step of each timed piece over one LLM.generate, the tokenizer, the vocabulary size)."""
    from aserve import LLM, SamplingParams
    from aserve.core.scheduler import Scheduler
    from aserve.engine.output_processor import OutputProcessor

    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}

    def timed(cls, name):
        inner = getattr(cls, name)

        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
                calls[name] = calls.get(name, 0) + 1

        setattr(cls, name, wrapper)
        return inner

    pieces = [(Scheduler, "schedule"), (Scheduler, "update_from_output"), (OutputProcessor, "process")]
    originals = [(cls, name, timed(cls, name)) for cls, name in pieces]
    try:
        llm = LLM(model=model, max_model_len=input_len + output_len + 16, max_num_seqs=seqs,
                  max_num_batched_tokens=max(2048, seqs * input_len))  # fmt: skip
        rng = random.Random(0)
        vocab = llm.llm_engine.config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(input_len)]} for _ in range(seqs)]
        llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        seconds.clear()
        calls.clear()
        llm.generate(prompts, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0), use_tqdm=False)
    finally:
        for cls, name, inner in originals:
            setattr(cls, name, inner)
    costs = {name: seconds[name] / calls[name] * 1e3 for name in seconds}
    return costs, llm.get_tokenizer(), vocab


class _Protocol(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport = transport


async def stream_costs(tokenizer, vocab: int, seqs: int, output_len: int) -> dict[str, float]:
    """us per sequence per step of OutputProcessor.process (DELTA) and EventStream.put (events + socket write)."""
    from types import SimpleNamespace

    from aserve.core.outputs import EngineCoreOutput
    from aserve.engine.output_processor import OutputProcessor
    from aserve.entrypoints.openai.event_stream import EventStream, FlowControl, http_chunk
    from aserve.entrypoints.openai.responses import ChoiceState
    from aserve.sampling_params import RequestOutputKind, SamplingParams

    loop = asyncio.get_running_loop()
    processor = OutputProcessor(tokenizer)
    streams, readers = [], []
    req = SimpleNamespace(n=1, include_usage=True, continuous_usage=False, return_token_ids=False, prompt_logprobs=None)
    for i in range(seqs):
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        processor.add_request(f"r{i}", None, [1, 2, 3], params, [f"r{i}"], RequestOutputKind.DELTA)
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        _, protocol = await loop.create_connection(_Protocol, sock=ours)
        stream = EventStream(None, "model", req, f"cmpl-{i}", 0, [ChoiceState(0, None)], 3, False,
                             FlowControl(1 << 24, 60.0))  # fmt: skip
        stream.transport, stream.frame = protocol.transport, http_chunk  # what go_direct() sets once headers are out
        streams.append(stream)
        readers.append(theirs)
    gc.collect()
    gc.freeze()  # as the server freezes what it loaded (llm_engine.freeze_for_serving)
    rng = random.Random(0)
    t_process = t_put = 0.0
    try:
        for step in range(output_len):
            last = step == output_len - 1
            outs = [EngineCoreOutput(f"r{i}", [rng.randrange(3, vocab)], finish_reason="length" if last else None)
                    for i in range(seqs)]  # fmt: skip
            t0 = time.perf_counter()
            outputs, _ = processor.process(outs)
            t1 = time.perf_counter()
            for stream, out in zip(streams, outputs):
                stream.put((0, out))
            await asyncio.sleep(0)  # the loop writes what the transports queued
            t2 = time.perf_counter()
            t_process, t_put = t_process + t1 - t0, t_put + t2 - t1
            for reader in readers:
                try:
                    while reader.recv(1 << 16):
                        pass
                except BlockingIOError:
                    pass
    finally:
        gc.unfreeze()
        for stream in streams:
            stream.transport.close()
        for reader in readers:
            reader.close()
    n = seqs * output_len
    return {"process": t_process / n * 1e6, "put": t_put / n * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory (default: a tiny random Llama)")
    p.add_argument("--seqs", type=int, default=256)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    model = args.model
    if model is None:
        from tiny_models import make_tiny_model

        model = make_tiny_model(os.path.join(tempfile.gettempdir(), "aserve-host-path-gqa"), "gqa")
    import uvloop

    engine, tokenizer, vocab = engine_costs(model, args.seqs, args.input_len, args.output_len)
    streams = uvloop.run(stream_costs(tokenizer, vocab, args.seqs, args.output_len))
    n = args.seqs
    print(f"\n{n} sequences, {args.output_len} steps\n\n| piece | ms per step | us per sequence |\n|---|---|---|")
    for name in ("schedule", "update_from_output", "process"):
        print(f"| engine: {name} | {engine[name]:.3f} | {engine[name] / n * 1e3:.2f} |")
    for name, label in (("process", "streams: process (DELTA)"), ("put", "streams: EventStream.put + write")):
        print(f"| {label} | {streams[name] * n / 1e3:.3f} | {streams[name]:.2f} |")


if __name__ == "__main__":
    main()
