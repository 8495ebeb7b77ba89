"""The PopTorch double's rules revised for issue 36, on small torch modules (no engine code). Each rule
cites graphcore/poptorch (or graphcore/popart) at sdk-release-3.4 in tests/sdk_double/poptorch:

* a non-floating-point parameter or buffer is a constant of the graph, not a PopART weight: listing it
  in updatableNamedBuffers is refused at lowering, an in-place update of it does not outlive the run,
  and copyWeightsToDevice / copyWeightsToHost copy nothing for it;
* copyNamedBuffersToDevice pairs the host tensors, sorted by name, with the device buffers in the order
  they were registered (torch's Module._apply order), as a raw copy of each device buffer's size;
* int64 and float64 tensors hold int32 and float32 values on the device; zero-sized inputs and weights
  are refused.
"""

from __future__ import annotations

import pytest

_NOT_AN_IR_TENSOR = (
    "Invalid named buffer in updatableNamedBuffers!\nNo Ir::Tensor with TensorId '{}' in Ir::getTensor(..) "
)


def _mask_and_cache():
    import torch

    class MaskAndCache(torch.nn.Module):
        """A float cache and an int32 mask, both grown in place by each call (as a decoder's state)."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(2))
            self.register_buffer("mask", torch.zeros(2, dtype=torch.int32))

        def forward(self, x):
            self.cache += x.sum(0)
            self.mask += 1
            # the mask as forward reads it after its update, in the same run
            return torch.cat([self.cache, self.mask.float()]).unsqueeze(0)

    return MaskAndCache


def test_an_int32_buffer_listed_in_updatable_named_buffers_is_refused_at_lowering(wrap):
    import poptorch
    import torch

    module = _mask_and_cache()().eval()
    refused = wrap(module, poptorch.Options().updatableNamedBuffers(["cache", "mask"]))
    with pytest.raises(poptorch.Error) as info:
        refused.compile(torch.ones(1, 2))
    assert info.value.type == "popart_exception"
    assert info.value.message == _NOT_AN_IR_TENSOR.format("mask")
    assert not refused.isCompiled()
    # The float buffer alone is a weight, and accepted.
    accepted = wrap(_mask_and_cache()().eval(), poptorch.Options().updatableNamedBuffers(["cache"]))
    accepted.compile(torch.ones(1, 2))
    assert accepted.isCompiled()


def test_an_int32_buffer_updated_in_place_stays_at_its_compile_time_value(wrap):
    import poptorch
    import torch

    module = _mask_and_cache()().eval()
    with torch.no_grad():
        module.mask.fill_(5)  # the host value when compiled is the constant's value
    executor = wrap(module, poptorch.Options().deviceIterations(2))
    x = torch.ones(2, 2)
    first, second = executor(x), executor(x)
    # The cache (a weight) grows from micro-batch to micro-batch and call to call; the mask reads 5 + 1
    # within each run, and is 5 again in the next.
    torch.testing.assert_close(first, torch.tensor([[1.0, 1.0, 6.0, 6.0], [2.0, 2.0, 6.0, 6.0]]))
    torch.testing.assert_close(second, torch.tensor([[3.0, 3.0, 6.0, 6.0], [4.0, 4.0, 6.0, 6.0]]))
    # copyWeightsToDevice does not reach a constant, and copyWeightsToHost does not write it back.
    with torch.no_grad():
        module.mask.fill_(100)
    executor.copyWeightsToDevice()  # also puts the host's cache (zeros) back on the device
    torch.testing.assert_close(executor(x), torch.tensor([[1.0, 1.0, 6.0, 6.0], [2.0, 2.0, 6.0, 6.0]]))
    executor.copyWeightsToHost()
    torch.testing.assert_close(module.mask, torch.full((2,), 100, dtype=torch.int32), rtol=0, atol=0)
    torch.testing.assert_close(module.cache, torch.full((2,), 2.0))


def test_an_in_place_update_of_a_constant_needs_no_broadcast_buffers_off(wrap):
    """Only a weight has an alias for update_param_inplace (InplaceOps.cpp), so only a weight updated in
    place trips the broadcast check with replicas."""
    import poptorch
    import torch

    class MaskOnly(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.zeros(2, dtype=torch.int32))

        def forward(self, x):
            self.mask += 1
            return x + self.mask

    executor = wrap(MaskOnly().eval(), poptorch.Options().replicationFactor(2))
    x = torch.zeros(2, 2)
    for _ in range(2):
        torch.testing.assert_close(executor(x), torch.ones(2, 2))
    with pytest.raises(poptorch.Error, match=r"broadcastBuffers\(False\)"):
        wrap(_mask_and_cache()().eval(), poptorch.Options().replicationFactor(2)).compile(torch.ones(2, 2))


def _states(*names: str, shapes=None):
    import torch

    class States(torch.nn.Module):
        """Buffers registered in the order given, returned in that order."""

        def __init__(self) -> None:
            super().__init__()
            for index, name in enumerate(names):
                self.register_buffer(name, torch.zeros(shapes[index] if shapes else (1, 3)))

        def forward(self, x):
            return tuple(x + getattr(self, name).reshape(1, -1) for name in names)

    return States()


def _upload(wrap, module, values: dict):
    """Compiles ``module`` with all its buffers updatable, writes ``values`` into the host buffers,
    uploads them with copyNamedBuffersToDevice and returns what the device then holds, by name."""
    import poptorch
    import torch

    names = [name for name, _ in module.named_buffers()]
    executor = wrap(module, poptorch.Options().updatableNamedBuffers(names))
    x = torch.zeros(1, 1)
    executor.compile(x)
    with torch.no_grad():
        for name, value in values.items():
            module.get_buffer(name).copy_(value)
    executor.copyNamedBuffersToDevice()
    return dict(zip(names, executor(x), strict=True))


def test_named_buffers_are_paired_by_name_order_with_the_registration_order(wrap):
    import torch

    nine, ten = torch.full((1, 3), 9.0), torch.full((1, 3), 10.0)
    # Registered state_9 then state_10; sorted, "state_10" comes first: each gets the other's values.
    device = _upload(wrap, _states("state_9", "state_10"), {"state_9": nine, "state_10": ten})
    torch.testing.assert_close(device["state_9"], ten)
    torch.testing.assert_close(device["state_10"], nine)
    # Zero-padded names sort as they are registered: each gets its own.
    device = _upload(wrap, _states("state_09", "state_10"), {"state_09": nine, "state_10": ten})
    torch.testing.assert_close(device["state_09"], nine)
    torch.testing.assert_close(device["state_10"], ten)


def test_the_registration_order_is_module_apply_order_children_first(wrap):
    """named_buffers() lists a module's own buffers before its children's (y, b, c.k); Module._apply,
    which moves them to the IPU, converts the children first (c.k, y, b); sorted, the names are b, c.k,
    y. So c.k gets b's values, y gets c.k's and b gets y's (pairing named_buffers() order with name
    order would give y b's, b c.k's and c.k y's)."""
    import torch

    class Parent(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("y", torch.zeros(1, 3))
            self.register_buffer("b", torch.zeros(1, 3))
            self.c = _states("k")

        def forward(self, x):
            return x + self.y, x + self.b, *self.c(x)

    module = Parent()
    assert [name for name, _ in module.named_buffers()] == ["y", "b", "c.k"]
    y, b, k = (torch.full((1, 3), value) for value in (1.0, 2.0, 3.0))
    device = _upload(wrap, module, {"y": y, "b": b, "c.k": k})
    torch.testing.assert_close(device["c.k"], b)
    torch.testing.assert_close(device["y"], k)
    torch.testing.assert_close(device["b"], y)


def test_paired_buffers_of_other_shapes_get_a_raw_copy_of_their_own_size(wrap):
    import poptorch
    import torch

    # state_9 is [2, 3], state_10 is [6]: the same bytes, so state_9 gets state_10's six values as [2, 3].
    shapes = [(2, 3), (6,)]
    module = _states("state_9", "state_10", shapes=shapes)
    values = {"state_9": torch.arange(6.0).reshape(2, 3), "state_10": torch.arange(10.0, 16.0)}
    device = _upload(wrap, module, values)
    torch.testing.assert_close(device["state_9"], torch.arange(10.0, 16.0).reshape(1, 6))
    torch.testing.assert_close(device["state_10"], torch.arange(6.0).reshape(1, 6))
    # state_9 is [4], state_10 is [2]: state_9 would be read from state_10's 8 bytes, past their end.
    module = _states("state_9", "state_10", shapes=[(4,), (2,)])
    with pytest.raises(poptorch.Error, match=r"16 bytes of PopART tensor 'state_9' .*'state_10' of 8 bytes"):
        _upload(wrap, module, {})


def test_int64_and_float64_hold_int32_and_float32_values_on_the_device(wrap):
    import torch

    class Probe(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("big", torch.tensor([2**32 + 7], dtype=torch.int64))

        def forward(self, ids, fine):
            # int32 values: 2**32 + 5 is 5 and 2**32 + 7 is 7; float32: 1 + 1e-12 is 1.
            return (ids == 5).float(), (self.big == 7).float(), (fine - 1.0) * 1e12

    executor = wrap(Probe().eval())
    ids = torch.tensor([2**32 + 5], dtype=torch.int64)
    fine = torch.tensor([1.0 + 1e-12], dtype=torch.float64)
    same, big, rounded = executor(ids, fine)
    torch.testing.assert_close(same, torch.ones(1))
    torch.testing.assert_close(big, torch.ones(1))
    torch.testing.assert_close(rounded, torch.zeros(1), rtol=0, atol=0)


def test_a_float64_weight_is_uploaded_as_raw_bytes_into_its_float32_tensor(wrap):
    """copyWeightsToDevice hands over the float64 host tensor's data pointer; the PopART weight is float32
    and takes its own 8 bytes from it: the halves of 1.0 as float64 (0x3FF0000000000000) read as 0.0 and
    1.875."""
    import torch

    class Weighted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("scale", torch.tensor([1.0, 2.0], dtype=torch.float64))

        def forward(self, x):
            return x + self.scale

    executor = wrap(Weighted().eval())
    torch.testing.assert_close(executor(torch.zeros(1, 2)), torch.tensor([[0.0, 1.875]]), rtol=0, atol=0)


def test_zero_sized_inputs_and_weights_are_refused_constants_are_not(wrap):
    import poptorch
    import torch

    class Empty(torch.nn.Module):
        def __init__(self, dtype) -> None:
            super().__init__()
            self.register_buffer("past", torch.zeros(1, 0, dtype=dtype))

        def forward(self, x):
            return torch.cat([x, self.past.float()], dim=1)

    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape \[1, 0\]\)\."):
        wrap(Empty(torch.float32)).compile(torch.ones(1, 2))
    with pytest.raises(poptorch.Error, match=r"Zero-sized tensors are unsupported \(Got shape \[1, 0\]\)\."):
        wrap(Empty(torch.int32)).compile(torch.ones(1, 0))
    accepted = wrap(Empty(torch.int32))
    torch.testing.assert_close(accepted(torch.ones(1, 2)), torch.ones(1, 2))
