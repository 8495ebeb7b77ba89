"""The rest of ``onnxruntime.InferenceSession``'s public API on the IPU session: refused, by name.

``IPUInferenceSession`` subclasses onnxruntime's Python ``InferenceSession`` (so ``isinstance`` checks in
user code and libraries pass) but never creates onnxruntime's native session: the graph runs on an IPU
engine. An onnxruntime method it inherited would reach for that native session (``self._sess``) and fail
far from the call. So every public name of onnxruntime's class is either implemented by the IPU
session or replaced, when the class is created, by a stub that raises ``UnsupportedSessionMethodError``
naming the method and what to use instead. ``REFUSED`` is the one table of those alternatives; a name a
later onnxruntime adds, which the table cannot know, gets a stub with a generic message.
"""

from __future__ import annotations

from typing import Any, NoReturn

from optimum_ipu_backend.errors import DeviceError

# method name -> why the IPU session cannot do it and what to use instead
REFUSED: dict[str, str] = {
    "set_providers": (
        "an IPUExecutionProvider session cannot switch providers in place; load the model again with "
        "the provider you want, e.g. ORTModel.from_pretrained(path, provider='CPUExecutionProvider')"
    ),
    "enable_fallback": (
        "the IPU provider never falls back to another provider while running; list fallback providers "
        "after ipu in providers= when you create the session: they take over when the IPU session "
        "cannot be created"
    ),
    "get_input_memory_infos": "inputs are fed from host memory; get_inputs() describes them",
    "get_output_memory_infos": "outputs are returned in host memory; get_outputs() describes them",
    "get_input_epdevices": (
        "inputs are fed from host memory, not from an onnxruntime device; get_inputs() describes them"
    ),
    "get_provider_graph_assignment_info": (
        "the whole graph runs on IPUExecutionProvider; session.compiled_executables() lists what was "
        "compiled and how often each executable ran"
    ),
    "create_ortvalue_from_shape_and_type": (
        "the IPU session has no onnxruntime allocator; create values on the CPU with "
        "onnxruntime.OrtValue.ortvalue_from_numpy(array)"
    ),
    "release_captured_graph": "the IPU session captures no onnxruntime graphs, so there is none to release",
    "set_ep_dynamic_options": (
        "the IPU provider's options cannot change after creation; pass them in provider_options when "
        "you create the session"
    ),
    "get_tuning_results": (
        "the IPU session does no onnxruntime kernel tuning; its compiled executables are kept in the "
        "executable cache (optimum-ipu cache list)"
    ),
    "set_tuning_results": (
        "the IPU session does no onnxruntime kernel tuning; its compiled executables are kept in the "
        "executable cache (optimum-ipu cache list)"
    ),
    "run_with_ortvaluevector": (
        "use run_with_ort_values(output_names, {name: OrtValue}) or run(output_names, {name: array})"
    ),
    "get_profiling_start_time_ns": (
        "the IPU session keeps no onnxruntime profile; session.compiled_executables() lists what was "
        "compiled and how often each executable ran"
    ),
}

# Marks the stubs, so a subclass does not count them as implementations.
_REFUSAL_MARK = "__ipu_refused__"


class UnsupportedSessionMethodError(DeviceError, NotImplementedError):
    """A method of ``onnxruntime.InferenceSession`` the IPU session cannot honour; the message names the
    method and what to use instead. A ``NotImplementedError`` too, as the refusal of ``set_providers``
    always was."""

    def __init__(self, owner: str, member: str, advice: str) -> None:
        super().__init__(f"{owner}.{member} is not supported: {advice}")
        self.owner, self.member, self.advice = owner, member, advice

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.owner, self.member, self.advice)


class NoNativeSessionError(UnsupportedSessionMethodError, AttributeError):
    """Raised on reading ``_sess``, onnxruntime's native session, which the IPU session never creates. An
    ``AttributeError``, so ``hasattr(session, "_sess")`` is False."""


def is_refusal(member: Any) -> bool:
    """Whether ``member`` (a class attribute) is one of the stubs installed by ``refuse_unimplemented``."""
    target = member.fget if isinstance(member, property) else member
    return bool(getattr(target, _REFUSAL_MARK, False))


def _generic_advice(name: str) -> str:
    import onnxruntime

    return (
        f"it comes with onnxruntime {onnxruntime.__version__}, and the IPU session, which has no native "
        "onnxruntime session, does not implement it yet; run() and the methods the user guide lists "
        "(The session is an onnxruntime.InferenceSession) are what it offers"
    )


def _refusal(owner: str, name: str, advice: str, as_property: bool) -> Any:
    member = name if as_property else f"{name}()"

    def refused(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise UnsupportedSessionMethodError(owner, member, advice)

    refused.__name__ = name
    refused.__qualname__ = f"{owner}.{name}"
    refused.__doc__ = f"Not supported by the IPU session: {advice}."
    setattr(refused, _REFUSAL_MARK, True)
    return property(refused) if as_property else refused


def _ours(cls: type, onnxruntime_class: type) -> list[type]:
    """The classes of ``cls``'s MRO that are not ``onnxruntime_class`` or one of its bases."""
    theirs = set(onnxruntime_class.__mro__)
    return [klass for klass in cls.__mro__ if klass not in theirs]


def refuse_unimplemented(cls: type, onnxruntime_class: type) -> None:
    """Give ``cls`` a refusing stub for every public name of ``onnxruntime_class`` (and every ``REFUSED``
    name) that no class of its own defines. A name both in ``REFUSED`` and implemented is a contradiction
    in this package, reported when the class is created."""
    ours = _ours(cls, onnxruntime_class)

    def implemented(name: str) -> bool:
        return any(name in vars(klass) and not is_refusal(vars(klass)[name]) for klass in ours)

    both = sorted(name for name in REFUSED if implemented(name))
    if both:
        raise TypeError(f"{cls.__name__} implements {both}, which REFUSED also lists; remove them from one")
    public = {name for name in dir(onnxruntime_class) if not name.startswith("_")}
    for name in sorted(public | set(REFUSED)):
        if any(name in vars(klass) for klass in ours):
            continue
        advice = REFUSED.get(name) or _generic_advice(name)
        inherited = getattr(onnxruntime_class, name, None)
        as_property = name in public and not callable(inherited)
        setattr(cls, name, _refusal(cls.__name__, name, advice, as_property))
