"""``IPUInferenceSession``: what optimum-onnx gets back from ``InferenceSession(...)`` for ipu.

It is an ``onnxruntime.InferenceSession`` (a subclass of onnxruntime's Python class, so ``isinstance``
checks pass) that never creates onnxruntime's native session: it owns the lifecycle of one ONNX file,
with checks at creation, per-call validation of the feed, and delegation to the runtime, which compiles
one executable per shape and runs it on the chosen engine. Each public method of onnxruntime's class is
implemented here or refused by name (``session/ort_surface.py``).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import onnxruntime

from optimum_ipu_backend.compiler.analysis.index_ranges import IndexRanges
from optimum_ipu_backend.engines import Engine, EngineClosedError
from optimum_ipu_backend.engines.probe import DEVICE_KINDS, EMULATION_NOTICE
from optimum_ipu_backend.errors import InvalidFeedError
from optimum_ipu_backend.runtime.batched_serving import BatchedServing
from optimum_ipu_backend.runtime.buckets import option_name
from optimum_ipu_backend.runtime.ipu_config import IPUProviderOptions
from optimum_ipu_backend.runtime.open import open_model
from optimum_ipu_backend.session.failures import failures_name_the_call
from optimum_ipu_backend.session.feeds import FeedValidator
from optimum_ipu_backend.session.io_binding import HostIOBinding
from optimum_ipu_backend.session.node_arg import NodeArg, node_arg
from optimum_ipu_backend.session.ort_surface import NoNativeSessionError, refuse_unimplemented

PROVIDER_NAME = "IPUExecutionProvider"
_NO_MODEL_VERSION = 2**63 - 1


class ProviderName(str):
    """Equal to (and hashes like) ``"IPUExecutionProvider"``, so optimum-onnx's lookups work, but shows
    where the computation really happens when printed, e.g. in ``model.providers``."""

    device: str

    def __new__(cls, device: str) -> ProviderName:
        value = super().__new__(cls, PROVIDER_NAME)
        value.device = device
        return value

    def __repr__(self) -> str:
        emulation = ", host emulation" if DEVICE_KINDS[self.device].host_emulation else ""
        return f"'{PROVIDER_NAME}' (device={self.device}{emulation})"


@dataclass
class ModelMetadata:
    """Mirrors ``onnxruntime.ModelMetadata``."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


class IPUInferenceSession(onnxruntime.InferenceSession):
    """An ``onnxruntime.InferenceSession`` that runs on an IPU engine.

    Its ``__init__`` does not call onnxruntime's, so no native onnxruntime session exists; the public
    methods of onnxruntime's class that are not implemented here raise ``UnsupportedSessionMethodError``
    naming what to use instead (``ort_surface.REFUSED``)."""

    is_provider_plugin_session = True
    # onnxruntime's private state that its own code and optimum read, mirrored where it holds here.
    _enable_fallback = False  # the provider never falls back while running (fallbacks apply at creation)
    _from_model_package = False

    def __init__(
        self,
        path_or_bytes: str | os.PathLike | bytes,
        sess_options: Any = None,
        options: IPUProviderOptions | None = None,
    ) -> None:
        # onnxruntime.InferenceSession.__init__ is not called: it would create a native session.
        is_path = not isinstance(path_or_bytes, (bytes, bytearray))
        self._model_path = str(path_or_bytes) if is_path else None
        self._model_bytes = None if is_path else path_or_bytes
        self._sess_options = sess_options
        self._closed = False
        if options is None:
            options = IPUProviderOptions.parse(None, Path(path_or_bytes).parent if is_path else None)
        self._open = open_model(path_or_bytes, options, threads=_threads_from(sess_options))
        self._finalizer = weakref.finalize(
            self, _close_session, self._open.batching, self._open.engine, self._open.runner.planner
        )
        self._runner = self._open.runner
        self._batching = self._open.batching

    @functools.cached_property
    def _inputs_meta(self) -> list[NodeArg]:
        return [node_arg(*spec) for spec in self._open.source.description.inputs]

    @functools.cached_property
    def _outputs_meta(self) -> list[NodeArg]:
        return [node_arg(*spec) for spec in self._open.source.description.outputs]

    @functools.cached_property
    def _fixed_shapes(self) -> bool:
        """Whether the model fixes every dimension of every input (no call chooses a size)."""
        return all(
            isinstance(dim, int) for _, dims, _ in self._open.source.description.inputs for dim in dims
        )

    @functools.cached_property
    def _output_names(self) -> list[str]:
        return [arg.name for arg in self._outputs_meta]

    @functools.cached_property
    def _validate_feed(self) -> FeedValidator:
        description = self._open.source.description
        ranges = IndexRanges.from_json(description.index_ranges)
        return FeedValidator(self._inputs_meta, ranges, description.initializer_defaults)

    # -- the InferenceSession surface -------------------------------------------------------------

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs_meta)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs_meta)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return []

    def get_providers(self) -> list[str]:
        return [ProviderName(self.device)]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        runtime, resolution, engine = self._open.options.runtime, self._open.resolution, self._open.engine
        options = {
            "device": resolution.device,
            "engine": resolution.engine,
            "precision": self._open.options.precision,
            "emulated": "1" if resolution.emulated else "0",
            "device_iterations": str(runtime.device_iterations),
            "replication_factor": str(runtime.replication_factor),
            "executable_cache": self._runner.cache_description,
            **{option_name(dim): ",".join(map(str, sizes)) for dim, sizes in self._runner.plan.sizes.items()},
        }
        if resolution.emulated:
            options["note"] = EMULATION_NOTICE
        if self._open.options.threads:
            options["threads"] = str(self._open.options.threads)
        if engine.sdk_version:
            options["sdk_version"] = engine.sdk_version
        if engine.sdk_python:
            options["sdk_python"] = engine.sdk_python
        return {PROVIDER_NAME: options}

    def get_session_options(self) -> Any:
        if self._sess_options is None:
            self._sess_options = onnxruntime.SessionOptions()
        return self._sess_options

    def get_modelmeta(self) -> ModelMetadata:
        model = self._open.source.model()
        return ModelMetadata(
            producer_name=model.producer_name,
            graph_name=model.graph.name,
            domain=model.domain,
            description=model.doc_string,
            graph_description=model.graph.doc_string,
            # onnxruntime reports a model without a version as the largest int64
            version=model.model_version if model.HasField("model_version") else _NO_MODEL_VERSION,
            custom_metadata_map={entry.key: entry.value for entry in model.metadata_props},
        )

    def disable_fallback(self) -> None:
        """Nothing to disable: the IPU provider never falls back to another provider while running."""

    def run(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        run_options: Any = None,
    ) -> list[np.ndarray]:
        names, feed = self._checked_call(output_names, input_feed)
        return self._execute(names, feed)

    def run_async(
        self,
        output_names: Sequence[str] | None,
        input_feed: Mapping[str, Any],
        callback: Callable[[list[np.ndarray], Any, str], None],
        user_data: Any,
        run_options: Any = None,
    ) -> None:
        """Run on a thread of its own and call ``callback(results, user_data, error)``, as onnxruntime does:
        ``error`` is ``""`` on success; on failure ``results`` is empty and ``error`` says what failed. A
        bad feed or output name raises here, before the thread starts."""
        names, feed = self._checked_call(output_names, input_feed)

        def work() -> None:
            try:
                results = self._execute(names, feed)
            except Exception as exc:  # handed to the callback, as onnxruntime hands over its status
                callback([], user_data, f"{type(exc).__name__}: {exc}")
                return
            callback(results, user_data, "")

        # Not a daemon: the interpreter waits for the call (and its callback) before it closes the engine.
        threading.Thread(target=work, name="IPUInferenceSession.run_async").start()

    def run_with_ort_values(
        self,
        output_names: Sequence[str] | None,
        input_dict_ort_values: Mapping[str, Any],
        run_options: Any = None,
    ) -> list[onnxruntime.OrtValue]:
        """``run`` on ``OrtValue`` inputs held in CPU memory; the results come back as CPU ``OrtValue``s."""
        feed = {}
        for name, value in input_dict_ort_values.items():
            device = value.device_name() if callable(getattr(value, "device_name", None)) else None
            if device is None:
                raise InvalidFeedError(
                    f"input {name!r} is a {type(value).__name__}; run_with_ort_values takes "
                    "onnxruntime.OrtValue inputs (run() takes numpy arrays)"
                )
            if device.lower() != "cpu":
                raise InvalidFeedError(
                    f"input {name!r} is an OrtValue on device {device!r}; the IPU provider is fed from host "
                    "memory, so pass CPU values (onnxruntime.OrtValue.ortvalue_from_numpy(array))"
                )
            feed[name] = value.numpy()
        results = self.run(output_names, feed, run_options)
        # A result trimmed from a padded executable can be a strided view; OrtValues wrap contiguous data.
        return [onnxruntime.OrtValue.ortvalue_from_numpy(np.asarray(r, order="C")) for r in results]

    def io_binding(self) -> HostIOBinding:
        return HostIOBinding(self.run, self._output_names)

    def run_with_iobinding(self, iobinding: HostIOBinding, run_options: Any = None) -> None:
        iobinding.run()

    def end_profiling(self) -> str:
        """No onnxruntime profile is kept, so there is no file: ``""``, as onnxruntime returns when
        profiling is off."""
        return ""

    @property
    def _sess(self) -> NoReturn:
        """onnxruntime's native session, which this session never creates (``onnxruntime.IOBinding(session)``
        and onnxruntime's own methods read it)."""
        raise NoNativeSessionError(
            type(self).__name__,
            "_sess",
            "the IPU session runs its graph on an IPU engine and has no native onnxruntime session; "
            "session.io_binding() gives its IO binding (onnxruntime.IOBinding(session) cannot)",
        )

    @property
    def _providers(self) -> list[str]:
        return self.get_providers()

    @property
    def _provider_options(self) -> dict[str, dict[str, str]]:
        return self.get_provider_options()

    def _checked_call(
        self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any]
    ) -> tuple[list[str], dict[str, np.ndarray]]:
        """The output names and the validated feed of one call, or the error that refuses it."""
        if self._closed:
            raise EngineClosedError(
                "this IPUInferenceSession was closed, which released its IPUs; create a new session "
                "(load the model again) to run"
            )
        names = list(output_names) if output_names else self._output_names
        unknown = [name for name in names if name not in self._output_names]
        if unknown:
            raise InvalidFeedError(
                f"unknown output(s) {unknown}; the model's outputs are {self._output_names}"
            )
        return names, self._validate_feed(input_feed)

    def _execute(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        with failures_name_the_call(feed, self._open.resolution.engine, fixed_shapes=self._fixed_shapes):
            if self._batching is not None:
                return self._batching.run(feed, names)
            return self._runner.run(feed, names)

    # -- beyond onnxruntime -----------------------------------------------------------------------

    def close(self) -> None:
        """Release the session's executables, IPUs and (when no other session uses it) the SDK worker
        process. Also runs when the session is garbage-collected and at interpreter exit."""
        self._closed = True
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> IPUInferenceSession:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def engine(self) -> Engine:
        return self._open.engine

    @property
    def device(self) -> str:
        return self._open.resolution.device

    @property
    def emulated(self) -> bool:
        return self._open.resolution.emulated

    def compiled_executables(self) -> list[dict[str, object]]:
        """Every executable compiled so far, with its input shapes, where it came from, the calls it
        served, the engine reloads (``switches``) its runs caused on a device shared with other
        executables, and the padding verdict of each dimension (padded because the padding proof holds,
        or compiled at exact sizes and the node that breaks the proof)."""
        verdicts = self._runner.padding_verdicts()
        entries = [{**entry, "padding": verdicts} for entry in self._runner.statistics()]
        batching = self._batching
        if batching is None:
            return entries
        packed = [] if batching.packed is None else batching.packed.table.statistics()
        return [
            {**entry, "packing": batching.packing_verdict}
            for entry in [*entries, *({**entry, "packed": True} for entry in packed)]
        ]

    def packing_verdict(self) -> str | None:
        """With ``dynamic_batching``: whether calls are packed into shared rows (the packing proof holds)
        or batched unpacked, and the node that stops the proof; None without dynamic batching."""
        return None if self._batching is None else self._batching.packing_verdict

    def padding_verdicts(self) -> dict[str, str]:
        """Per dimension tried so far: ``"padded (proven)"``, or ``"exact sizes: <node and reason>"``."""
        return self._runner.padding_verdicts()

    def kv_cache_verdict(self) -> str | None:
        """For a decoder with a key/value cache: whether its decoding steps keep the cache on the device
        (one decode executable) or stream it, and why; None for other graphs."""
        return self._runner.kv_cache_verdict()

    def precompile(
        self,
        fixed_dims: Mapping[str, int] | None = None,
        *,
        progress: bool = False,
        parallel: int | None = None,
    ) -> list[dict[str, Any]]:
        """Compile every bucket signature into the executable cache now (``optimum-ipu compile``); one
        record per signature: shapes, branches, ``source`` ("compiled" or "cache"), seconds."""
        from optimum_ipu_backend.runtime.precompile import compile_buckets

        return compile_buckets(self._runner, fixed_dims=fixed_dims, progress=progress, parallel=parallel)

    def graph_notes(self) -> list[str]:
        """What serving changed in the exported graph and what it costs (e.g. experts computed densely)."""
        return list(self._open.source.description.notes)

    def serving_plan(self) -> dict[str, Any] | None:
        """With ``serving_plan="cost"``: the plan (sizes and packed layouts per group of calls), the length
        histograms behind it and the cost model's figures with their sources; None otherwise."""
        planner = self._runner.planner
        return None if planner is None else planner.report()

    def wait_for_compiles(self, timeout: float | None = None) -> bool:
        """Wait until the background compiles of the serving plan are done (True), or ``timeout`` seconds
        pass (False); True at once without a serving plan."""
        planner = self._runner.planner
        return True if planner is None else planner.wait_for_compiles(timeout)

    def bucket_sizes(self) -> dict[str, list[int]]:
        """The compiled sizes of every padded dimension."""
        return self._runner.plan.to_dict()


# Each public name of onnxruntime's class not defined above raises, naming what to use instead; none is
# left to onnxruntime's code, which would reach for the native session this class never creates.
refuse_unimplemented(IPUInferenceSession, onnxruntime.InferenceSession)


def _close_session(batching: BatchedServing | None, engine: Engine, planner: Any = None) -> None:
    # Queued calls are released (with an error) before the engine they would run on goes.
    if planner is not None:
        planner.close()  # no background compile starts on a closing engine
    if batching is not None:
        batching.close()
    engine.close()


def _threads_from(sess_options: Any) -> int | None:
    threads = getattr(sess_options, "intra_op_num_threads", 0) if sess_options is not None else 0
    return threads or None
