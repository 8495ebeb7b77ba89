"""Fill the executable cache ahead of serving: every bucket of every graph of a model.

``fill_cache`` is what ``optimum-ipu compile MODEL`` runs, and what other tools (``optimum-cli export
ipu``) call after exporting. It opens each graph exactly as a serving session would (same provider
options, same cache keys), compiles every bucket signature, and closes the session. With
``offline=True`` the Poplar SDK compiles for an offline IPU target, without hardware; the entries it
writes are the ones a session on IPU hardware of that architecture reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.session.inference_session import IPUInferenceSession


def model_graphs(model: str | Path) -> list[Path]:
    """The ONNX graphs of ``model``: the file itself, or every ``*.onnx`` of an export directory."""
    path = Path(model)
    if path.is_file():
        return [path]
    graphs = sorted(path.glob("*.onnx"))
    if not graphs:
        raise FileNotFoundError(f"{path} is neither an ONNX file nor a directory holding *.onnx graphs")
    return graphs


def fill_cache(
    model: str | Path,
    provider_options: Mapping[str, Any] | None = None,
    *,
    offline: bool = False,
    ipu_version: str | None = None,
    fixed_dims: Mapping[str, int] | None = None,
    progress: bool | None = None,
    parallel: int | None = None,
) -> list[dict[str, Any]]:
    """Compile every bucket of every graph of ``model`` into the executable cache; returns, per graph, the
    device, engine, cache location and one record per executable (shapes, ``source``, seconds).
    ``fixed_dims`` sizes the dimensions no bucket plans (image sizes, audio frames)."""
    graphs = model_graphs(model)
    options = IPUProviderOptions.parse(provider_options, graphs[0].parent)
    options = replace(options, offline=offline, ipu_version=ipu_version, compile="lazy")
    report = []
    for graph in graphs:
        with IPUInferenceSession(str(graph), options=options) as session:
            records = session.precompile(fixed_dims, progress=bool(progress), parallel=parallel)
            provider = session.get_provider_options()["IPUExecutionProvider"]
            report.append(
                {
                    "graph": str(graph),
                    "device": provider["device"],
                    "engine": provider["engine"],
                    "offline": offline,
                    "executable_cache": provider["executable_cache"],
                    "executables": records,
                }
            )
    return report
