"""Host<->device link traffic per generated token of today's streaming decoders (issue 25, point 4: the
baseline that a device-resident key-value cache is compared with).

    python benchmarks/bench_generation_traffic.py [--new-tokens 64] [--contexts 64,512] [--json FILE]

Every device step goes through ``ExecutableTable.run_step`` (``runtime.executables``), which hands the
engine the padded feed and gets the outputs back; the benchmark wraps it and sums, step by step, the
bytes of the arrays the engine receives (each input's element count times the device dtype it is
converted to there, ``CompiledEntry.device_input_dtypes``) and returns (``nbytes`` of every output).
Inputs whose role is past keys and values (``runtime.roles.input_role(name) is InputRole.PAST``) and
outputs named ``present*`` are the carried STATE; ids, masks, positions and logits are THE REST.

What a step actually needs is taken from the unpadded arrays the session is called with and returns
(``IPUInferenceSession._execute``, under ``run``, ``run_async`` and IO binding): one position (axis -2)
of every ``present*`` output, the last position of the logits, and the step's own non-state inputs
(ids, the attention mask, positions) at the device dtype. "measured / needed" is the ratio of the two
totals. Per-token figures are a generation's totals divided by the tokens it generated (the prompt's
step included); device steps are ``run_step`` calls; executables are the decoder sessions'
``compiled_executables()`` after the generation (compiled, or loaded from the run's executable cache).

Context: for a decoder-only model, the prompt length. For the seq2seq decoders, the encoder's output
length (the cross-attention keys and values every decoder step reads): T5's input tokens; Whisper's is
fixed by the model (3000 mel frames -> 1500 positions), so it has one context. The decoder's own past
grows from its start tokens to the generated length. Only the decoder sessions are counted (the encoder
runs once per generation). A case whose positions exceed the model's limit runs at the largest valid
size and says so in its context column: a decoder-only model's prompt + new tokens within ``n_positions``
(new tokens cut to at most half of it, the prompt to the rest); a seq2seq decoder's start tokens + new
tokens within ``max_target_positions``. A capped case equal to a row already run is skipped.

Models are the conformance zoo's tiny random ones (``conformance.zoo.ModelZoo``: hidden 32, 2 layers, 4
heads), batch 1, ``provider="ipu"`` on the host emulator with a fresh executable cache. Modes: greedy,
seeded sampling, 4-beam search, each forced to exactly ``--new-tokens`` tokens. Byte counts are exact
and do not depend on the machine; wall times are host emulation, not IPU measurements.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from bench_runtime import describe_machine  # one description of the machine for every benchmark

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["OPTIMUM_IPU_PROGRESS"] = "0"  # bars would interleave with the table

KIB = 1024


class Case(NamedTuple):
    """One model of the table: a zoo model, the ORTModel class serving it, its export task, and what its
    context is (``"prompt"``: decoder-only; ``"encoder-text"``: T5-like; ``"audio"``: Whisper-like)."""

    label: str
    zoo_name: str
    ort_class: str
    task: str
    context: str


#: Add a model with one line. GPT-2 and Whisper are the zoo's ``*-long`` variants, with the position limits
#: of the real models (1,024 and 448), so that 512 tokens of context and 256 new ones fit.
CASES: tuple[Case, ...] = (
    Case("GPT-2", "gpt2-long", "ORTModelForCausalLM", "text-generation-with-past", "prompt"),
    Case("Llama", "llama", "ORTModelForCausalLM", "text-generation-with-past", "prompt"),
    Case("T5 decoder", "t5", "ORTModelForSeq2SeqLM", "text2text-generation-with-past", "encoder-text"),
    Case(
        "Whisper decoder",
        "whisper-long",
        "ORTModelForSpeechSeq2Seq",
        "automatic-speech-recognition-with-past",
        "audio",
    ),
)

#: Decoding modes: generate() keyword arguments (sampling is seeded with torch.manual_seed before the call).
MODES: dict[str, dict[str, Any]] = {
    "greedy": {"do_sample": False, "num_beams": 1},
    "sampling": {"do_sample": True, "num_beams": 1},
    "beam 4": {"do_sample": False, "num_beams": 4},
}

# ORTModel attributes holding sessions
DECODER_PARTS = ("model", "decoder", "decoder_with_past")
ENCODER_PARTS = ("encoder",)


@dataclass
class Traffic:
    """Bytes over the link and bytes needed, summed over the decoder's steps of one generation."""

    state_in: int = 0
    state_out: int = 0
    rest_in: int = 0
    rest_out: int = 0
    steps: int = 0
    calls: int = 0
    needed_state_out: int = 0
    needed_rest_in: int = 0
    needed_rest_out: int = 0
    uploads: int = 0  # state uploads (``ExecutableTable.write_state``): counted in state_in
    step_bytes: list[int] = field(default_factory=list)  # in + out of each step, in order
    first_ids: int | None = None  # input_ids length of the first decoder call: the prompt it starts from
    state_in_elements: int = 0  # cross-checked against the executables' compiled shapes x calls

    @property
    def measured(self) -> int:
        return self.state_in + self.state_out + self.rest_in + self.rest_out

    @property
    def needed(self) -> int:
        return self.needed_state_out + self.needed_rest_in + self.needed_rest_out


def is_state_input(name: str) -> bool:
    from optimum_ipu_backend.runtime.roles import InputRole, input_role

    return input_role(name) is InputRole.PAST


def is_state_output(name: str) -> bool:
    return name.startswith("present")


class LinkMeter:
    """Wraps ``ExecutableTable.run_step`` (link bytes) and ``IPUInferenceSession._execute`` (what the
    caller passed and got) while active; counts only calls of the sessions in ``watched``."""

    def __init__(self) -> None:
        self.watched: set[int] = set()
        self.traffic = Traffic()
        self._current = threading.local()

    def _record_step(
        self, table: Any, shapes: Any, branches: Any, feed: Mapping[str, np.ndarray], outputs: Any
    ) -> None:
        session = getattr(self._current, "session", None)
        if session is None or id(session) not in self.watched:
            return
        entry = table.entry_for(shapes, branches)  # already loaded: run_step just used it
        traffic = self.traffic
        step = 0
        itemsizes = {}
        for name, dtype in entry.device_input_dtypes.items():
            itemsizes[name] = np.dtype(dtype).itemsize
            size = int(np.asarray(feed[name]).size) * itemsizes[name]  # what to_device_dtype hands the engine
            step += size
            if is_state_input(name):
                traffic.state_in += size
                traffic.state_in_elements += int(np.asarray(feed[name]).size)
            else:
                traffic.rest_in += size
        for name, array in outputs.items():
            size = int(np.asarray(array).nbytes)
            step += size
            if is_state_output(name):
                traffic.state_out += size
            else:
                traffic.rest_out += size
        traffic.steps += 1
        traffic.step_bytes.append(step)
        self._current.itemsizes = itemsizes

    def _record_upload(self, values: Mapping[str, np.ndarray]) -> None:
        session = getattr(self._current, "session", None)
        if session is None or id(session) not in self.watched:
            return
        self.traffic.state_in += sum(int(np.asarray(value).nbytes) for value in values.values())
        self.traffic.uploads += 1

    def _record_call(
        self,
        session: Any,
        feed: Mapping[str, np.ndarray],
        names: Sequence[str],
        results: Sequence[np.ndarray],
    ) -> None:
        if id(session) not in self.watched:
            return
        traffic = self.traffic
        traffic.calls += 1
        if traffic.first_ids is None and "input_ids" in feed:
            traffic.first_ids = int(np.asarray(feed["input_ids"]).shape[-1])
        itemsizes = getattr(self._current, "itemsizes", {})
        for name, array in feed.items():
            if not is_state_input(name):
                array = np.asarray(array)
                traffic.needed_rest_in += array.size * itemsizes.get(name, array.dtype.itemsize)
        for name, array in zip(names, results, strict=True):
            array = np.asarray(array)
            if is_state_output(name):
                # one position of the sequence axis of [batch, heads, positions, head size]
                if array.ndim != 4:
                    raise ValueError(
                        f"{name} has shape {array.shape}; expected [batch, heads, positions, head]"
                    )
                traffic.needed_state_out += array.nbytes // max(array.shape[-2], 1)
            elif name == "logits":
                traffic.needed_rest_out += array.nbytes // max(array.shape[1], 1)  # the last position
            else:
                traffic.needed_rest_out += array.nbytes

    @contextlib.contextmanager
    def active(self) -> Iterator[LinkMeter]:
        from optimum_ipu_backend.runtime.executables import ExecutableTable
        from optimum_ipu_backend.session.inference_session import IPUInferenceSession

        meter = self
        original_step, original_execute = ExecutableTable.run_step, IPUInferenceSession._execute
        original_write = ExecutableTable.write_state

        def write_state(table: Any, entry: Any, values: Mapping[str, np.ndarray]) -> None:
            original_write(table, entry, values)
            meter._record_upload(values)

        def run_step(table: Any, micro_shapes: Any, branches: Any, feed: Any) -> dict[str, np.ndarray]:
            outputs = original_step(table, micro_shapes, branches, feed)
            meter._record_step(table, micro_shapes, branches, feed, outputs)
            return outputs

        def execute(session: Any, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
            meter._current.session = session
            try:
                results = original_execute(session, names, feed)
            finally:
                meter._current.session = None
            meter._record_call(session, feed, names, results)
            return results

        ExecutableTable.run_step, IPUInferenceSession._execute = run_step, execute  # type: ignore[method-assign]
        ExecutableTable.write_state = write_state  # type: ignore[method-assign]
        try:
            yield self
        finally:
            ExecutableTable.run_step, IPUInferenceSession._execute = original_step, original_execute  # type: ignore[method-assign]
            ExecutableTable.write_state = original_write  # type: ignore[method-assign]


def sessions_of(model: Any, parts: Sequence[str]) -> list[Any]:
    """The ipu sessions of these ORTModel attributes (as tests/integration/ortmodel_checks.py finds them):
    Whisper's ``model`` attribute is a torch stand-in, not a session, and is skipped."""
    found = [getattr(model, name, None) for name in parts]
    sessions = [getattr(part, "session", part) for part in found if part is not None]
    return [session for session in sessions if hasattr(session, "compiled_executables")]


def decoder_sessions(model: Any) -> list[Any]:
    """The decoder sessions of an ORTModel. A seq2seq ORTModel's ``model`` may be its encoder's session,
    so the encoder's sessions are taken out."""
    encoder = {id(session) for session in sessions_of(model, ENCODER_PARTS)}
    return [session for session in sessions_of(model, DECODER_PARTS) if id(session) not in encoder]


def position_limit(config: Any, case: Case) -> int | None:
    """The most decoder positions the model has (None: relative positions, no limit)."""
    if case.context == "audio":
        return int(config.max_target_positions)
    for attribute in ("n_positions", "max_position_embeddings"):
        if case.context == "prompt" and getattr(config, attribute, None):
            return int(getattr(config, attribute))
    return None


def build_inputs(case: Case, model_dir: Path, context: int, seed: int) -> tuple[dict[str, Any], int]:
    """generate() inputs of ``context`` tokens of context (seeded random tokens, or a random waveform for
    Whisper) and the context length they give."""
    import torch
    import transformers

    rng = np.random.default_rng(seed)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if case.context == "audio":
        extractor = transformers.AutoFeatureExtractor.from_pretrained(model_dir)
        wave = (0.1 * rng.standard_normal(extractor.n_samples)).astype(np.float32)
        features = extractor(wave, sampling_rate=extractor.sampling_rate, return_tensors="np")[
            "input_features"
        ]
        return {"input_features": torch.from_numpy(np.asarray(features, dtype=np.float32))}, int(
            config.max_source_positions
        )
    # Ordinary tokens: above every special id, so no prompt token is a pad or end of sequence.
    low = max(config.pad_token_id or 0, config.eos_token_id or 0, config.bos_token_id or 0) + 1
    ids = rng.integers(low, config.vocab_size, size=(1, context), dtype=np.int64)
    return {
        "input_ids": torch.from_numpy(ids),
        "attention_mask": torch.ones_like(torch.from_numpy(ids)),
    }, context


def sizes_for(case: Case, config: Any, context: int, new_tokens: int, start: int) -> tuple[int, int, str]:
    """(context, new tokens, note): the asked sizes, or the largest valid ones under the position limit."""
    limit = position_limit(config, case)
    if limit is None:
        return context, new_tokens, ""
    if case.context == "prompt":
        if context + new_tokens <= limit:
            return context, new_tokens, ""
        new = min(new_tokens, limit // 2)
        valid_context = min(context, limit - new)
        return (
            valid_context,
            min(new_tokens, limit - valid_context),
            (f"asked {context}+{new_tokens}; n_positions {limit}"),
        )
    if start + new_tokens <= limit:  # the seq2seq decoder starts from ``start`` tokens
        return context, new_tokens, ""
    return context, limit - start, f"asked {new_tokens} new; max_target_positions {limit}"


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Tracer, deprecation and generation-config notes would bury the table."""
    import transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            transformers.logging.set_verbosity(verbosity)


def generate_once(
    case: Case,
    onnx_dir: Path,
    cache_dir: Path,
    inputs: Mapping[str, Any],
    mode: str,
    new_tokens: int,
    seed: int,
    prefix: int,
    kv_cache: str = "device",
) -> dict[str, Any]:
    """One generation on a freshly loaded ipu model; its link traffic, steps and executables. ``prefix``:
    the tokens generate() returns before the generated ones (the prompt, or a seq2seq decoder's start)."""
    import optimum.onnxruntime as ort_models
    import torch

    cls = getattr(ort_models, case.ort_class)
    options = {"device": "emulator", "executable_cache_dir": str(cache_dir), "kv_cache": kv_cache}
    model = cls.from_pretrained(onnx_dir, provider="ipu", provider_options=options)
    sessions = decoder_sessions(model)
    if not sessions:
        raise RuntimeError(f"no ipu decoder session found in {case.ort_class}")
    meter = LinkMeter()
    meter.watched = {id(session) for session in sessions}
    torch.manual_seed(seed)
    started = time.perf_counter()
    with meter.active(), torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **MODES[mode])
    seconds = time.perf_counter() - started
    executables = [entry for session in sessions for entry in session.compiled_executables()]
    traffic = meter.traffic
    # An independent count of the same steps: each streaming executable's compiled past shapes times the
    # calls it served (one micro-batch per step at the default device_iterations = replicas = 1); a decode
    # executable that keeps the cache on the device (``kv_cache``) is fed no past.
    compiled = sum(
        int(entry["calls"])
        * sum(math.prod(shape) for name, shape in entry["shapes"].items() if is_state_input(name))
        for entry in executables
        if entry.get("kv_cache") != "device"
    )
    if compiled != traffic.state_in_elements:
        raise RuntimeError(
            f"{case.label} {mode}: the wrapped steps fed {traffic.state_in_elements} past elements, the "
            f"executables' shapes x calls say {compiled}"
        )
    return {
        "tokens": int(tokens.shape[1]) - prefix,
        "output_length": int(tokens.shape[1]),
        "traffic": traffic,
        "executables": len(executables),
        "decode_executables": sum(entry.get("kv_cache") == "device" for entry in executables),
        "executable_sources": sorted(str(entry["source"]) for entry in executables),
        "seconds": seconds,
    }


def decoder_prompt(case: Case, onnx_dir: Path, cache_dir: Path, inputs: Mapping[str, Any]) -> tuple[int, int]:
    """(tokens generate() returns before the generated ones, tokens the decoder starts from): the prompt
    for a decoder-only model; for a seq2seq one, from a short greedy generation (Whisper starts from forced
    tokens that its generate() does not return)."""
    if case.context == "prompt":
        return int(inputs["input_ids"].shape[1]), int(inputs["input_ids"].shape[1])
    probe = generate_once(case, onnx_dir, cache_dir, inputs, "greedy", 2, 0, prefix=0)
    return probe["tokens"] - 2, int(probe["traffic"].first_ids)


def run_case(
    case: Case,
    zoo: Any,
    cache_dir: Path,
    contexts: Sequence[int],
    new_tokens: int,
    seed: int,
    kv_caches: Sequence[str] = ("device",),
) -> list[dict[str, Any]]:
    import transformers

    onnx_dir = zoo.onnx(case.zoo_name, case.task)
    config = transformers.AutoConfig.from_pretrained(onnx_dir)
    rows: list[dict[str, Any]] = []
    done: set[tuple[int, int]] = set()
    for asked in contexts if case.context != "audio" else contexts[:1]:
        inputs, context = build_inputs(case, onnx_dir, asked, seed)
        prefix, start = decoder_prompt(case, onnx_dir, cache_dir, inputs)
        context, new, note = sizes_for(case, config, context, new_tokens, start)
        if (context, new) in done:
            print(f"- {case.label}: context {asked} ({note}) is the same as a row above; skipped", flush=True)
            continue
        done.add((context, new))
        if case.context == "prompt" and context != asked:
            inputs, context = build_inputs(case, onnx_dir, context, seed)
            prefix = context
        for mode in MODES:
            for kv_cache in kv_caches:  # interleaved, so that both see the same machine
                result = generate_once(case, onnx_dir, cache_dir, inputs, mode, new, seed, prefix, kv_cache)
                if result["tokens"] != new:
                    raise RuntimeError(
                        f"{case.label} {mode}: generated {result['tokens']} tokens, asked {new}"
                    )
                rows.append(
                    {
                        "model": case.label,
                        "mode": mode,
                        "kv_cache": kv_cache,
                        "context": context,
                        "new": new,
                        "note": note,
                        **result,
                    }
                )
                print(
                    f"- {case.label} {mode} kv_cache={kv_cache} context {context}: {result['seconds']:.1f} s",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def kib(value: float) -> str:
    return f"{value / KIB:.2f}"


def row_figures(row: Mapping[str, Any]) -> dict[str, Any]:
    traffic: Traffic = row["traffic"]
    per = row["tokens"]
    return {
        "model": row["model"],
        "mode": row["mode"],
        "kv_cache": row["kv_cache"],
        "context": row["context"],
        "new_tokens": row["new"],
        "note": row["note"],
        "state_in_per_token": traffic.state_in / per,
        "state_out_per_token": traffic.state_out / per,
        "rest_in_per_token": traffic.rest_in / per,
        "rest_out_per_token": traffic.rest_out / per,
        "measured_per_token": traffic.measured / per,
        "needed_per_token": traffic.needed / per,
        "needed_state_out_per_token": traffic.needed_state_out / per,
        "needed_rest_in_per_token": traffic.needed_rest_in / per,
        "needed_rest_out_per_token": traffic.needed_rest_out / per,
        "ratio": traffic.measured / traffic.needed,
        "last_step_bytes": traffic.step_bytes[-1],
        "device_steps": traffic.steps,
        "session_calls": traffic.calls,
        "executables": row["executables"],
        "decode_executables": row["decode_executables"],
        "uploads": traffic.uploads,
        "executable_sources": row["executable_sources"],
        "seconds": row["seconds"],
    }


def print_table(figures: Sequence[Mapping[str, Any]]) -> None:
    print(
        "| model | mode | kv_cache | context | new | state in KiB/tok | state out KiB/tok | "
        "rest in KiB/tok | rest out KiB/tok | needed KiB/tok | measured / needed | last step KiB | "
        "device steps | uploads | executables (decode) | wall s |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for f in figures:
        context = f"{f['context']}" + (f" ({f['note']})" if f["note"] else "")
        print(
            f"| {f['model']} | {f['mode']} | {f['kv_cache']} | {context} | {f['new_tokens']} | "
            f"{kib(f['state_in_per_token'])} | {kib(f['state_out_per_token'])} | "
            f"{kib(f['rest_in_per_token'])} | {kib(f['rest_out_per_token'])} | "
            f"{kib(f['needed_per_token'])} | {f['ratio']:.1f}x | {kib(f['last_step_bytes'])} | "
            f"{f['device_steps']} | {f['uploads']} | {f['executables']} ({f['decode_executables']}) | "
            f"{f['seconds']:.1f} |"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--new-tokens", type=int, default=64, help="tokens each generation makes (issue: 256)"
    )
    parser.add_argument("--contexts", default="64,512", help="context lengths, comma-separated")
    parser.add_argument("--models", help="comma-separated labels of CASES to run (default: all)")
    parser.add_argument(
        "--kv-cache",
        default="device,host",
        help="where the key/value cache is kept (the provider option kv_cache): device, host, or both",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompt tokens, waveform and sampling seed")
    parser.add_argument("--workdir", type=Path, help="keep the zoo here (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)
    contexts = [int(value) for value in args.contexts.split(",")]
    wanted = None if args.models is None else {label.strip() for label in args.models.split(",")}
    cases = [case for case in CASES if wanted is None or case.label in wanted or case.zoo_name in wanted]

    from optimum_ipu_backend.conformance.zoo import ModelZoo

    print(f"`python {' '.join([os.path.relpath(__file__), *sys.argv[1:]])}`\n")
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"{describe_machine()}; load average {load} at the start.\n")
    started = time.perf_counter()
    figures: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-traffic-") as scratch, quiet():
        zoo = ModelZoo(args.workdir or Path(scratch) / "zoo")
        cache_dir = Path(scratch) / "executables"
        for case in cases:
            figures.extend(
                row_figures(row)
                for row in run_case(
                    case, zoo, cache_dir, contexts, args.new_tokens, args.seed, args.kv_cache.split(",")
                )
            )
    print()
    print_table(figures)
    total = time.perf_counter() - started
    print(f"\nTotal wall time {total:.0f} s.")
    if args.json:
        args.json.write_text(json.dumps({"figures": figures, "seconds": total}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
