"""EleutherAI's lm-eval harness, run to the end against fairbatch's /v1/completions with its
`local-completions` model: a multiple_choice task (loglikelihood requests: token-id prompts with
`echo`, `logprobs: 1`, `max_tokens: 1`) and a generate_until task, both batched two prompts a
request (`--batch_size 2`). Datasets are JSON-lines files and tasks YAML files written here
(`--include_path`), the tokenizer the tiny model's own as a local HF directory; the harness runs
as its CLI in a subprocess with the hub switched off, against an app on loopback.

Checked: both tasks report their metric; every request lm-eval sent was answered 200 and the
server admitted exactly one engine request per prompt lm-eval asked about (docs x choices,
plus one per generation doc); the loglikelihoods lm-eval computed from the server's echoed
log-probs equal the engine's own prompt log-probs (`LLM.generate(..., prompt_logprobs=0)`);
the generations equal the engine's greedy output under the same stop strings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from loopback import ServerLoop

from fairbatch.deployments.api.backend import LocalBackend, create_app
from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.llm import build_engine
from fairbatch.engine.tokenizer import ASSETS_DIR

pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[test]')")
transformers = pytest.importorskip("transformers")

MODEL = "fairbatch-tiny"
KEY = "key-lm-eval"
TENANT = "evals"
BATCH = 2
GEN_TOKS = 5
RUN_TIMEOUT_S = 240

MC_DOCS = [
    {"question": q, "choices": c, "answer": a}
    for q, c, a in [
        ("The scheduler decides", ["who runs next", "nothing", "the KV"], 0),
        ("Paged attention keeps the cache in", ["one slab", "blocks", "disk"], 1),
        ("Tenants share the", ["keyboard", "weather", "GPU"], 2),
        ("A block holds sixteen", ["tokens", "tenants", "requests"], 0),
        ("Continuous batching adds requests", ["at noon", "each step", "never"], 1),
    ]
]
GEN_DOCS = [
    {"prompt": "Fair scheduling means", "target": " equal shares"},
    {"prompt": "The engine streams", "target": " tokens"},
    {"prompt": "Prefix caching reuses", "target": " blocks"},
]

MC_YAML = """task: fb_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_YAML = """task: fb_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {gen_toks}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


class Recorder:
    """ASGI middleware: the JSON body and response status of every POST /v1/completions."""

    def __init__(self, app) -> None:
        self.app = app
        self.bodies: list[dict] = []
        self.statuses: list[int] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/v1/completions":
            return await self.app(scope, receive, send)
        parts: list[bytes] = []

        async def recv():
            msg = await receive()
            if msg["type"] == "http.request":
                parts.append(msg.get("body", b""))
                if not msg.get("more_body"):
                    self.bodies.append(json.loads(b"".join(parts)))
            return msg

        async def snd(msg):
            if msg["type"] == "http.response.start":
                self.statuses.append(msg["status"])
            await send(msg)

        await self.app(scope, recv, snd)


def write_inputs(root: Path) -> tuple[Path, Path]:
    """The tasks (YAML + JSON-lines data) and the tokenizer directory, under `root`."""
    tasks, tok = root / "tasks", root / "tokenizer"
    tasks.mkdir()
    tok.mkdir()
    for name, docs, template in (("mc", MC_DOCS, MC_YAML), ("gen", GEN_DOCS, GEN_YAML)):
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        (tasks / f"fb_{name}.yaml").write_text(
            template.format(data=data, cache=root / "hf_cache", gen_toks=GEN_TOKS)
        )
    (tok / "tokenizer.json").write_bytes((ASSETS_DIR / "tiny_tokenizer.json").read_bytes())
    (tok / "tokenizer_config.json").write_bytes(
        (ASSETS_DIR / "tiny_tokenizer_config.json").read_bytes()
    )
    return tasks, tok


def one_file(out: Path, pattern: str) -> Path:
    found = sorted(out.rglob(pattern))
    assert len(found) == 1, (pattern, found)
    return found[0]


@pytest.fixture(scope="module")
def ref():
    return LLM("tiny")


def test_lm_eval_harness_runs_both_tasks_against_the_server(tmp_path, ref):
    tasks, tok_dir = write_inputs(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    text = "Paged attention keeps the cache in blocks"
    assert hf_tok(text, add_special_tokens=False).input_ids == ref.tokenizer.encode(text)[1:]

    loop = ServerLoop()
    backend = LocalBackend(build_engine("tiny", num_gpu_blocks=256, max_num_seqs=8))
    app = create_app(backend, {"tenants": [{"name": TENANT, "api_key": KEY}]})
    recorder = Recorder(app)
    try:
        url = loop.serve(recorder)
        out = tmp_path / "out"
        env = {
            **os.environ,
            "OPENAI_API_KEY": KEY,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf_home"),
            "TOKENIZERS_PARALLELISM": "false",
        }
        model_args = ",".join([
            f"base_url={url}/v1/completions", f"model={MODEL}", f"tokenizer={tok_dir}",
            "tokenizer_backend=huggingface", "num_concurrent=1", "max_retries=1",
        ])  # fmt: skip
        cmd = [
            sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
            "--model_args", model_args, "--tasks", "fb_mc", "fb_gen",
            "--include_path", str(tasks), "--batch_size", str(BATCH),
            "--output_path", str(out), "--log_samples",
        ]  # fmt: skip
        proc = subprocess.run(
            cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=RUN_TIMEOUT_S
        )
        assert proc.returncode == 0, proc.stderr[-6000:]
        tenant = app.state.registry.tenants[TENANT]
        admitted = tenant.requests_admitted
    finally:
        loop.run(backend.shutdown())
        loop.close()

    results = json.loads(one_file(out, "results_*.json").read_text())["results"]
    acc = results["fb_mc"]["acc,none"]
    assert 0.0 <= acc <= 1.0
    assert 0.0 <= results["fb_gen"]["exact_match,none"] <= 1.0

    # What went over the wire: every request answered 200, two prompts a request at most, and
    # one admitted engine request per prompt - docs x choices scores plus one per generation.
    assert recorder.statuses == [200] * len(recorder.bodies)
    scores = [b for b in recorder.bodies if b.get("echo")]
    gens = [b for b in recorder.bodies if not b.get("echo")]
    n_scores = sum(len(d["choices"]) for d in MC_DOCS)
    assert all(1 <= len(b["prompt"]) <= BATCH for b in recorder.bodies)
    assert sum(len(b["prompt"]) for b in scores) == n_scores
    assert sum(len(b["prompt"]) for b in gens) == len(GEN_DOCS)
    assert len(scores) == math.ceil(n_scores / BATCH)
    assert len(gens) == math.ceil(len(GEN_DOCS) / BATCH)
    assert admitted == n_scores + len(GEN_DOCS)
    assert all(b["max_tokens"] == 1 and b["logprobs"] == 1 for b in scores)
    assert all(b["max_tokens"] == GEN_TOKS and b["temperature"] == 0 for b in gens)
    sent = [ids for b in scores for ids in b["prompt"]]

    # lm-eval's loglikelihoods are the engine's own prompt log-probs of the continuation, and
    # its accuracy the share of docs whose best-scored choice (by the engine) is the answer.
    mc = [json.loads(line) for line in one_file(out, "samples_fb_mc_*.jsonl").open()]
    assert len(mc) == len(MC_DOCS)
    score_params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    right = 0
    for sample in mc:
        doc = sample["doc"]
        args = list(sample["arguments"].values())
        assert len(args) == len(sample["resps"]) == len(doc["choices"])
        engine_lls = []
        for arg, resp in zip(args, sample["resps"]):
            context, continuation = arg["arg_0"], arg["arg_1"]
            # lm-eval's split: encode the whole; the context's length marks the continuation
            ctx = hf_tok(context, add_special_tokens=False).input_ids
            whole = hf_tok(context + continuation, add_special_tokens=False).input_ids
            assert whole in sent and len(whole) > len(ctx)
            got = ref.generate([whole], score_params, use_tqdm=False)[0].prompt_logprobs
            expect = sum(got[i][0][1] for i in range(len(ctx), len(whole)))
            assert float(resp[0][0]) == pytest.approx(expect, abs=1e-4), (context, continuation)
            engine_lls.append(expect)
        right += max(range(len(engine_lls)), key=engine_lls.__getitem__) == doc["answer"]
    assert acc == pytest.approx(right / len(MC_DOCS))

    # Generations: the engine's greedy text for the same ids, cut at the same stops.
    gen = [json.loads(line) for line in one_file(out, "samples_fb_gen_*.jsonl").open()]
    assert len(gen) == len(GEN_DOCS)
    for sample in gen:
        context = sample["arguments"]["gen_args_0"]["arg_0"]
        ids = hf_tok(context, add_special_tokens=False).input_ids
        stop = ["\n", hf_tok.eos_token]
        params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKS, stop=stop)
        assert sample["resps"][0][0] == ref.generate([ids], params, use_tqdm=False)[0].text
