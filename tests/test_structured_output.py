"""Structured output in the engine, on a tiny random model: greedy output equal to transformers' logits masked by an
xgrammar matcher step by step; every kind of constraint followed, sampled and greedy, with n, speculative decoding and
async scheduling; grammars compiled in a pool and cached; requests waiting for their grammar; compile errors; matchers
freed. (The OpenAI server and the default model: test_structured_output_server.py.)"""

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch
import xgrammar as xgr

from aserve import LLM, SamplingParams, StructuredOutputsParams
from aserve.core.structured_output import choice_grammar, grammar_key, json_strings_escaped
from aserve.sampling_params import ParamError
from aserve.worker.grammar_bitmask import GrammarBitmask, apply_bitmask_cpu

# Bounded (pattern, maxItems, integer ranges) so that even random weights end the JSON. The string is ASCII: xgrammar
# 0.2.9 lets a string's characters be overlong UTF-8 sequences (3 bytes for one character; Python decodes them as 3
# replacement characters), which random weights do sample (real ones do not: see test_structured_output_server.py).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{0,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,4}-\d{2}"
CHOICES = ["yes", "no", 'say "maybe"']
EBNF = 'root ::= "(" digit digit? ("," digit)? ")"\ndigit ::= [0-9]'
EBNF_AS_REGEX = r"\(\d\d?(,\d)?\)"
KINDS = {
    "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "regex": StructuredOutputsParams(regex=REGEX),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar=EBNF),
}


def follows(kind: str, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(REGEX, text) is not None
    if kind == "choice":
        return text in CHOICES
    return re.fullmatch(EBNF_AS_REGEX, text) is not None


# Text prompts: random token ids may end inside a UTF-8 character, which the first output text would then finish.
PROMPTS = ["Hello world!", "The quick brown fox", "A paged KV cache stores keys", "Chunked prefill splits"]


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, debug_invariants=True)


def run(llm, kind, prompts=PROMPTS, **kw):
    params = SamplingParams(structured_outputs=KINDS[kind], max_tokens=kw.pop("max_tokens", 120), **kw)
    return [c for o in llm.generate(prompts, params) for c in o.outputs]


def test_greedy_equals_masked_transformers(llm, tiny_model):
    """Greedy decoding under a grammar = at each position, the argmax of transformers' logits over the tokens the
    matcher allows; the matcher then accepts it; the stop token ends it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=hf.config.vocab_size, stop_token_ids=[1])
    compiler = xgr.GrammarCompiler(info)
    for kind, grammar in (("json", compiler.compile_json_schema(json.dumps(json_strings_escaped(SCHEMA)),
                                                                any_whitespace=False)),
                          ("grammar", compiler.compile_grammar(EBNF))):  # fmt: skip
        for p in PROMPTS[:2]:
            matcher, ids, ref = xgr.GrammarMatcher(grammar), tokenizer.encode(p), []
            mask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)
            while not matcher.is_terminated():
                with torch.no_grad():
                    logits = hf(torch.tensor([ids])).logits[0, -1:].float()
                matcher.fill_next_token_bitmask(mask)
                xgr.apply_token_bitmask_inplace(logits, mask)
                token = int(logits.argmax())
                assert matcher.accept_token(token)
                ids.append(token)
                ref.append(token)
            out = run(llm, kind, [p], temperature=0, max_tokens=100)[0]
            assert out.token_ids == ref and out.finish_reason == "stop" and ref[-1] == 1
            assert follows(kind, out.text)


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_output_follows_its_grammar(llm, kind):
    """Greedy and sampled (n=2, seeded): each sequence has its own matcher and ends ("stop") where its grammar does."""
    outs = run(llm, kind, temperature=0) + run(llm, kind, temperature=1.0, seed=3, n=2)
    assert len(outs) == 3 * len(PROMPTS)
    for out in outs:
        assert out.finish_reason == "stop" and follows(kind, out.text), out.text
    sampled = [o.text for o in outs[len(PROMPTS) :]]
    assert len(set(sampled)) > 1  # sampling still samples, within the grammar


def test_length_cut_is_a_prefix_and_batches_mix(llm):
    """max_tokens reached first: finish_reason "length" and a prefix of a valid output. Unconstrained requests in
    the same batch are untouched."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    full = run(llm, "json", PROMPTS[:1], temperature=0)[0]
    params = [SamplingParams(structured_outputs=KINDS["json"], temperature=0, max_tokens=5), free, free, free]
    outs = llm.generate([PROMPTS[0]] + PROMPTS[1:], params)
    cut = outs[0].outputs[0]
    assert cut.finish_reason == "length" and cut.token_ids == full.token_ids[:5]
    assert [o.outputs[0].token_ids for o in outs[1:]] == alone[1:]


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_verifies_drafts_against_the_grammar(tiny_model, llm, method):
    """Drafts pass through the matcher: a draft the grammar refuses is rejected at its position, so greedy outputs
    are those of decoding without speculation, and sampled ones still follow the grammar."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    if method == "draft_model":
        spec = {"method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3}
    spec_llm = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, debug_invariants=True,
                   speculative_config=spec)  # fmt: skip
    for kind in ("json", "grammar"):
        ref = [o.token_ids for o in run(llm, kind, temperature=0)]
        assert [o.token_ids for o in run(spec_llm, kind, temperature=0)] == ref
        for out in run(spec_llm, kind, temperature=1.0, seed=5, n=2):
            assert out.finish_reason == "stop" and follows(kind, out.text)
    stats = spec_llm.engine.stats
    assert stats.spec_draft_tokens_total > 0
    if method == "draft_model":  # the target drafting for itself, unaware of the grammar: drafts get rejected
        assert stats.spec_accepted_tokens_total < stats.spec_draft_tokens_total


def test_async_scheduling_gives_the_same_outputs(tiny_model, llm):
    """Constrained requests switch async scheduling's overlap off while they are live (their mask needs every earlier
    token): a batch mixing them with unconstrained ones returns what one-step-at-a-time scheduling does."""
    overlapped = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, debug_invariants=True,
                     async_scheduling=True)  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(structured_outputs=KINDS["json"], temperature=0.8, seed=2, max_tokens=60),
              SamplingParams(temperature=0.9, seed=4, max_tokens=20, ignore_eos=True, n=2),
              SamplingParams(structured_outputs=KINDS["regex"], temperature=0, max_tokens=60)]  # fmt: skip

    def texts(engine_llm):
        return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in engine_llm.generate(PROMPTS, params)]

    assert texts(overlapped) == texts(llm)
    core = overlapped.engine.core
    assert core.inflight is None and not core._sync_requests
    assert core.kv_manager.pool.num_free_blocks == core.num_kv_blocks


def test_preemption_keeps_the_grammar_state(tiny_model, llm):
    """A preempted sequence is recomputed from its tokens; its matcher, which has seen them, carries on."""
    small = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=128, num_gpu_blocks_override=12,
                debug_invariants=True)  # fmt: skip
    prompts = PROMPTS * 2
    outs = run(small, "json", prompts, temperature=0)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in run(llm, "json", prompts, temperature=0)]


def test_grammars_compile_once_per_key(llm):
    manager = llm.engine.core.structured_output
    params = StructuredOutputsParams(regex=r"x\d+y")
    first = manager.compile(params)
    assert manager.compile(StructuredOutputsParams(regex=r"x\d+y")) is first
    assert manager.compile(StructuredOutputsParams(regex=r"x\d+z")) is not first
    assert first.result() is not None
    # A schema's key keeps its properties' order (it orders the output); whitespace options are part of it.
    assert grammar_key(StructuredOutputsParams(json={"b": 1, "a": 2})) != grammar_key(
        StructuredOutputsParams(json={"a": 2, "b": 1})
    )
    assert grammar_key(KINDS["json"]) != grammar_key(StructuredOutputsParams(json=SCHEMA))


def test_what_does_not_compile_is_refused_before_anything_is_queued(llm):
    cases = [
        (
            StructuredOutputsParams(json={"type": "strin"}),
            'the JSON schema cannot be compiled: Unsupported type "strin"',
        ),
        (
            StructuredOutputsParams(json='{"type": '),
            "the JSON schema is not valid JSON: Expecting value: line 1 column 10",
        ),
        (StructuredOutputsParams(regex="a(b"), "the regex cannot be compiled: .*parenthesis is not closed"),
        (StructuredOutputsParams(regex="(?=a)b"), "the regex cannot be compiled: lookahead and lookbehind"),
        (StructuredOutputsParams(grammar='root ::= "a" |'), "the EBNF grammar cannot be compiled: EBNF parser error"),
        (  # a keyword xgrammar would drop (core/json_schema_support.py)
            StructuredOutputsParams(
                json={"type": "object", "properties": {"l": {"type": "array", "uniqueItems": True}}}
            ),
            r"the JSON schema's `uniqueItems` \(at /properties/l\) is not supported",
        ),
    ]
    for so, message in cases:
        with pytest.raises(ParamError, match=message) as info:
            llm.generate(PROMPTS, SamplingParams(structured_outputs=so))
        assert info.value.param == "structured_outputs" and "/project/" not in str(info.value)
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(
        ParamError, match="exactly one of json, regex, choice, grammar, json_object or structural_tag, got regex, "
    ):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ParamError, match="got none"):
        StructuredOutputsParams()
    with pytest.raises(ParamError, match="non-empty list of strings"):
        StructuredOutputsParams(choice=[])
    deep = {"type": "string"}
    for i in range(60):  # 120 levels of the schema document: its compile would take seconds
        deep = {"type": "object", "properties": {f"k{i}": deep}, "required": [f"k{i}"]}
    for schema in (deep, json.dumps(deep), "[" * 5000 + "]" * 5000):
        with pytest.raises(ParamError, match="nests more than 100 levels"):
            StructuredOutputsParams(json=schema)


def test_requests_wait_for_their_grammar(llm, monkeypatch):
    """A request whose grammar is still compiling is not scheduled (the others run past it); once compiled it runs;
    one whose grammar fails ends with an error. Finished and aborted requests drop their matchers."""
    engine = llm.engine
    manager = engine.core.structured_output
    compiled = manager.compile(StructuredOutputsParams(regex="[a-z]{3}")).result()
    pending: dict[str, Future] = {}
    monkeypatch.setattr(manager, "compile", lambda so: pending.setdefault(so.regex, Future()))
    sp = SamplingParams(temperature=0, max_tokens=40)
    engine.add_request("slow", PROMPTS[0], sp.clone(structured_outputs=StructuredOutputsParams(regex="slow")))
    engine.add_request("bad", PROMPTS[1], sp.clone(structured_outputs=StructuredOutputsParams(regex="bad")))
    engine.add_request("free", PROMPTS[2], sp.clone(max_tokens=3, ignore_eos=True))
    finished = {}
    for _ in range(20):  # (with async scheduling, the default on CUDA, a step may only wait for the one in flight)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if finished:
            break
    assert list(finished) == ["free"]
    assert [r.request_id for r in engine.core.scheduler.waiting] == ["slow", "bad"]
    pending["bad"].set_exception(ParamError("structured_outputs", "the regex cannot be compiled: it is bad"))
    pending["slow"].set_result(compiled)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    bad = finished["bad"]
    assert bad.outputs[0].finish_reason == "error" and bad.error == "the regex cannot be compiled: it is bad"
    slow = finished["slow"].outputs[0]
    assert slow.finish_reason == "stop" and re.fullmatch("[a-z]{3}", slow.text)
    assert engine.core.kv_manager.pool.num_free_blocks == engine.core.num_kv_blocks


def test_a_queued_compile_no_request_needs_is_cancelled(tiny_model):
    """With the pool's two threads busy, a third grammar's compile waits in the pool's queue; once every request
    that needed it has gone (aborted, or a server handler whose client left), it is cancelled and forgotten, so a
    client cannot queue costly compiles ahead of the others and leave; a compile still needed goes on."""
    import threading

    from aserve.core.structured_output import StructuredOutputManager

    gate = threading.Event()
    manager = StructuredOutputManager(LLM(tiny_model, dtype="float32", enforce_eager=True).get_tokenizer(), 384, 1)
    real = manager._compile
    manager._compile = lambda key: gate.wait(10) and real(key)  # the pool's threads held until the gate opens
    busy = [manager.compile(StructuredOutputsParams(regex=r)) for r in ("a", "b")]
    while not all(f.running() for f in busy):  # both threads taken
        gate.wait(0.01)
    queued = manager.compile(StructuredOutputsParams(regex="c+"))
    states = [manager.sequence_state(queued) for _ in range(2)]  # two sequences need it
    states[0].free()
    assert not queued.cancelled()  # one still does
    states[1].free()
    assert queued.cancelled()
    again = manager.compile(StructuredOutputsParams(regex="c+"))  # a new request for it compiles it afresh
    assert again is not queued
    waiting = manager.sequence_state(busy[0])
    waiting.free()  # running already: not cancelled, and it finishes for whoever asks next
    gate.set()
    assert not busy[0].cancelled() and busy[0].result() is not None and again.result() is not None


def test_abort_frees_the_matcher(llm):
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(structured_outputs=KINDS["json"], max_tokens=50))
    while not engine.core.scheduler.running:
        engine.step()
    request = engine.core.scheduler.running[0]
    assert request.grammar.matcher is not None
    engine.abort_request("a")
    assert request.grammar.matcher is None and not engine.has_unfinished_requests()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bitmask_masks_only_constrained_rows(llm, dtype):
    """Rows of constrained requests get -inf outside the grammar (drafts' rows in their matcher's state after the
    drafts before them, which are rolled back); other rows are untouched; the non-finite flags are the raw rows'."""
    engine = llm.engine
    manager = engine.core.structured_output
    grammar = manager.compile(StructuredOutputsParams(choice=["xq", "xj"])).result()
    x, q, j = engine.tokenizer.convert_tokens_to_ids(["x", "q", "j"])  # single tokens; no token holds two of them

    class Row:  # what the bitmask reads of a request
        def __init__(self, constrained):
            self.grammar = manager.sequence_state(Future()) if constrained else None
            if constrained:
                self.grammar.matcher = xgr.GrammarMatcher(grammar)

    requests = [Row(True), Row(False), Row(True)]
    drafts = [[x, q], [7], [q]]  # request 0: "x" then "q" allowed; request 2: "q" refused at its first row
    vocab = 384
    logits = torch.randn(7, vocab).to(dtype)
    logits[3, 5] = float("nan")  # request 1's first row: unconstrained, flagged
    raw = logits.clone()
    nonfinite = GrammarBitmask(torch.device("cpu")).apply(logits, requests, drafts)
    assert nonfinite.tolist() == [False, False, False, True, False, False, False]
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits.float()]
    assert allowed[0] == [x] and allowed[1] == sorted([q, j])
    assert allowed[2] == [1]  # after "xq": only the stop token
    assert torch.equal(logits[3:5].nan_to_num(), raw[3:5].nan_to_num())  # request 1 untouched
    assert allowed[5] == [x] and torch.equal(logits[6], raw[6])  # request 2: "q" refused there, its next row unused
    assert requests[0].grammar.matcher.accept_string("xj")  # the drafts were rolled back

    # Greedy on the CPU: the argmax of the raw logits, kept where the grammar accepts it, else the masked row's.
    requests = [Row(True), Row(False), Row(True)]
    raw[0, x] = raw[1, q] = 50.0  # accepted where they are; every other constrained row's argmax is refused
    unmasked = raw.nan_to_num().float().max(dim=-1).indices
    argmax = unmasked.clone()
    GrammarBitmask(torch.device("cpu")).correct_greedy(raw, requests, drafts, argmax, lambda t: t.float().argmax(-1))
    assert argmax[:3].tolist() == [x, q, 1] and argmax[5].item() == x
    assert torch.equal(argmax[3:5], unmasked[3:5]) and argmax[6] == unmasked[6]  # unconstrained, unused
    assert requests[0].grammar.matcher.accept_string("xj") and requests[2].grammar.matcher.accept_string("xq")


def test_bitmask_rows_wait_for_the_grammars_start_token(llm):
    """A grammar waiting for its start token leaves the rows up to the one whose draft is that token free and masks
    the rows after it; the wait holds until the start token is accepted into the sequence."""
    engine = llm.engine
    manager = engine.core.structured_output
    grammar = manager.compile(StructuredOutputsParams(choice=["xq", "xj"])).result()
    x, q, j, end = engine.tokenizer.convert_tokens_to_ids(["x", "q", "j", "z"])
    state = manager.sequence_state(Future(), after=end)
    state.matcher = xgr.GrammarMatcher(grammar)

    class Row:
        grammar = state

    logits = torch.randn(5, 384)
    raw = logits.clone()
    GrammarBitmask(torch.device("cpu")).apply(logits, [Row()], [[q, end, x, q]])
    assert torch.equal(logits[:2], raw[:2])  # before `end` and at it: free
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits[2:]]
    assert allowed == [[x], sorted([q, j]), [1]]
    assert GrammarBitmask(torch.device("cpu")).fill([Row()], [[q, x]], 384) is None  # nothing constrained yet
    assert state.accept(q) and not state.terminated and state.after == end  # free tokens leave the matcher alone
    assert state.accept(end) and state.after is None
    assert not state.accept(q) and state.accept(x)  # the grammar applies now


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [384, 395])
def test_apply_bitmask_cpu_equals_xgrammar(dtype, vocab):
    """By words (all ones, zero, mixed; a partial last word), exactly xgrammar's kernel, on rows with a stride."""
    gen = torch.Generator().manual_seed(0)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, words), dtype=torch.int32, generator=gen)
    bitmask[0] = -1
    bitmask[1] = 0
    bitmask[2, ::2] = -1
    bitmask[3, 1::3] = 0
    logits = torch.randn(5, vocab + 7, generator=gen).to(dtype)[:, :vocab]
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    apply_bitmask_cpu(logits, bitmask)
    assert torch.equal(logits, expected)
    assert torch.isinf(logits[1]).all() and torch.isfinite(logits[0]).all()


def test_choice_grammar_escapes():
    assert choice_grammar(['a "b"', "c\\d", "e\nf"]) == 'root ::= "a \\"b\\"" | "c\\\\d" | "e\\nf"'
    escaped = json_strings_escaped({"type": "object", "properties": {"enum": {"type": "string", "maxLength": 3}},
                                    "enum": [{"type": "string", "maxLength": 1}]})  # fmt: skip
    assert escaped["properties"]["enum"] == {"type": "string", "pattern": '^[^\\x00-\\x1f"\\\\]{0,3}$'}
    assert escaped["enum"] == [{"type": "string", "maxLength": 1}]  # data, not a schema


def _run_engine(engine, params, prompt, **kw) -> list[list[int]]:
    engine.add_request("r", prompt, params, **kw)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    return [c.token_ids for c in finished[0].outputs]


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}])
def test_grammar_waits_for_its_start_token(tiny_model, llm, spec):
    """grammar_after (a reasoning model's `</think>`): the tokens up to and including it are the model's own, the
    grammar constrains the rest; a reply that never samples it is free throughout. Drafts through the start token are
    verified against the grammar from the row after it."""
    engine = llm.engine
    if spec is not None:
        engine = LLM(tiny_model, dtype="float32", enforce_eager=True, max_model_len=256, debug_invariants=True,
                     speculative_config=spec).engine  # fmt: skip
    prompt = "The quick brown fox"
    free = _run_engine(engine, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), prompt)[0]
    k = next(i for i in range(2, 12) if free[i] not in free[:i])
    constrained = SamplingParams(structured_outputs=KINDS["regex"], temperature=0, max_tokens=60, n=2)
    for ids in _run_engine(engine, constrained, prompt, grammar_after=free[k]):
        assert ids[: k + 1] == free[: k + 1]
        assert follows("regex", engine.tokenizer.decode(ids[k + 1 :], skip_special_tokens=True))
    never = next(t for t in range(3, 300) if t not in free)
    assert _run_engine(engine, SamplingParams(structured_outputs=KINDS["regex"], temperature=0, max_tokens=12),
                       prompt, grammar_after=never) == [free]  # fmt: skip
    core = engine.core
    assert not core.scheduler.has_unfinished() and core.kv_manager.pool.num_free_blocks == core.num_kv_blocks


def test_vllm_backend_options(llm):
    """vLLM's disable_fallback and disable_additional_properties are taken (xgrammar is the only backend; a schema
    object without additionalProperties is closed); whitespace_pattern is refused by name."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["a"]}  # fmt: skip
    so = StructuredOutputsParams(json=open_schema, disable_fallback=True, disable_additional_properties=True,
                                 disable_any_whitespace=True)  # fmt: skip
    params = SamplingParams(structured_outputs=so, max_tokens=40, temperature=1.0, seed=3, n=4)
    outputs = [c for o in llm.generate(PROMPTS, params) for c in o.outputs]
    assert len(outputs) == 16
    for c in outputs:
        assert c.finish_reason == "stop", c.text
        assert set(json.loads(c.text)) == {"a"}, c.text
    with pytest.raises(ParamError, match="whitespace_pattern is not supported"):
        StructuredOutputsParams(json=open_schema, whitespace_pattern=r"[\n ]*")
    with pytest.raises(ParamError, match="disable_fallback must be a boolean"):
        StructuredOutputsParams(json=open_schema, disable_fallback="yes")
