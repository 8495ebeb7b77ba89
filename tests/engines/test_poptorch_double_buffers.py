"""Module buffers updated in place, as the PopTorch double keeps them (issue #25: a key/value cache that
stays on the device). tests/sdk_double/poptorch cites the graphcore/poptorch source (sdk-release-3.4)
behind each rule:

* the executor uploads its own copy of the parameters and buffers on every attach and runs on it, so
  in-place updates accumulate on the device from call to call and from device iteration to the next;
* an inference model never copies them back by itself: the user's module keeps its values until
  ``copyWeightsToHost()``, and a detach or ``destroy()`` loses the device's;
* ``index_copy_`` has no handler and fails the compile;
* with replicas, an in-place buffer update is refused unless ``broadcastBuffers(False)``, and then each
  replica keeps its own buffer.
"""

from __future__ import annotations

import pytest


def _counter_class():
    import torch

    class Counter(torch.nn.Module):
        """Adds each micro-batch's column sums to a buffer in place and returns the buffer's new value."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(2))
            self.scale = torch.nn.Parameter(torch.full((2,), 2.0), requires_grad=False)

        def forward(self, x):
            self.total += x.sum(0)
            return (self.total * self.scale).unsqueeze(0)

    return Counter


def test_in_place_updates_accumulate_on_the_device_and_reach_the_host_only_when_copied(wrap):
    import torch

    module = _counter_class()().eval()
    host_total = module.total
    executor = wrap(module)
    x = torch.tensor([[1.0, 10.0]])
    outputs = [executor(x) for _ in range(3)]
    # The device's buffer grew by x on every call: 1x, 2x, 3x (times the parameter 2).
    for calls, output in enumerate(outputs, start=1):
        torch.testing.assert_close(output, 2.0 * calls * x, rtol=0, atol=0)
    # The user's module, read directly or through the executor, still holds the value from before.
    torch.testing.assert_close(module.total, torch.zeros(2), rtol=0, atol=0)
    torch.testing.assert_close(executor.total, torch.zeros(2), rtol=0, atol=0)
    executor.copyWeightsToHost()
    assert module.total is host_total  # written into the host tensor itself
    torch.testing.assert_close(module.total, 3.0 * x[0], rtol=0, atol=0)
    torch.testing.assert_close(module.scale, torch.full((2,), 2.0), rtol=0, atol=0)


def test_the_device_copy_is_replaced_only_by_an_upload(wrap):
    import poptorch
    import torch

    module = _counter_class()().eval()
    executor = wrap(module)
    x = torch.ones(1, 2)
    executor(x)
    executor(x)
    # A host change reaches the device only with copyWeightsToDevice.
    with torch.no_grad():
        module.total.fill_(100.0)
    torch.testing.assert_close(executor(x), torch.full((1, 2), 2.0 * 3), rtol=0, atol=0)
    executor.copyWeightsToDevice()
    torch.testing.assert_close(executor(x), torch.full((1, 2), 2.0 * 101), rtol=0, atol=0)
    # Detaching copies nothing back in inference; the next attach uploads the host values again.
    executor.detachFromDevice()
    torch.testing.assert_close(module.total, torch.full((2,), 100.0), rtol=0, atol=0)
    with pytest.raises(poptorch.Error, match="not attached"):
        executor.copyWeightsToHost()
    torch.testing.assert_close(executor(x), torch.full((1, 2), 2.0 * 101), rtol=0, atol=0)
    executor.destroy()
    torch.testing.assert_close(module.total, torch.full((2,), 100.0), rtol=0, atol=0)
    with pytest.raises(poptorch.Error, match="has not been compiled or has been destroyed"):
        executor.copyWeightsToHost()


def test_the_state_carries_from_one_device_iteration_to_the_next(wrap):
    import poptorch
    import torch

    executor = wrap(_counter_class()().eval(), poptorch.Options().deviceIterations(3))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    expected = 2.0 * torch.cumsum(x, 0)
    torch.testing.assert_close(executor(x), expected, rtol=0, atol=0)
    torch.testing.assert_close(executor(x), expected + 2.0 * x.sum(0), rtol=0, atol=0)


def test_index_copy_has_no_handler_and_fails_the_compile(wrap):
    import poptorch
    import torch

    class IndexCopy(torch.nn.Module):
        def __init__(self, in_place: bool) -> None:
            super().__init__()
            self.in_place = in_place
            self.register_buffer("cache", torch.zeros(4, 2))

        def forward(self, x):
            position = torch.tensor([1])
            if self.in_place:
                self.cache.index_copy_(0, position, x)
                return self.cache + 0
            return self.cache.index_copy(0, position, x)

    for in_place in (True, False):
        module = IndexCopy(in_place)
        executor = wrap(module)
        with pytest.raises(
            poptorch.Error, match=r"Unsupported ops found in compiled model: \[aten::index_copy\]"
        ) as info:
            executor.compile(torch.ones(1, 2))
        assert info.value.type == "poptorch_cpp_error"
        assert not executor.isCompiled()
        torch.testing.assert_close(module.cache, torch.zeros(4, 2), rtol=0, atol=0)


def test_an_in_place_buffer_update_with_replicas_needs_broadcast_buffers_off(wrap):
    import poptorch
    import torch

    x = torch.tensor([[1.0, 1.0], [2.0, 2.0]])  # one micro-batch per replica
    refused = wrap(_counter_class()().eval(), poptorch.Options().replicationFactor(2))
    with pytest.raises(
        poptorch.Error,
        match=r"disable buffer broadcasting using poptorch\.Options\.broadcastBuffers\(False\)",
    ) as info:
        refused.compile(x)
    assert info.value.type == "poptorch_cpp_error"
    assert not refused.isCompiled()

    module = _counter_class()().eval()
    options = poptorch.Options().replicationFactor(2).broadcastBuffers(False)
    executor = wrap(module, options)
    for _ in range(3):
        y = executor(x)
    # Each replica added its own micro-batch three times.
    torch.testing.assert_close(y, 2.0 * 3 * x, rtol=0, atol=0)
    torch.testing.assert_close(module.total, torch.zeros(2), rtol=0, atol=0)

    class Reads(torch.nn.Module):
        """A buffer only read: nothing to broadcast, so replicas are accepted."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("offset", torch.tensor([1.0, 2.0]))

        def forward(self, x):
            return x + self.offset

    reads = wrap(Reads(), poptorch.Options().replicationFactor(2))
    torch.testing.assert_close(reads(x), x + torch.tensor([1.0, 2.0]), rtol=0, atol=0)


def test_a_buffer_replaced_in_forward_is_refused(wrap):
    import poptorch
    import torch

    class Replaces(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("total", torch.zeros(2))

        def forward(self, x):
            self.total = self.total + x.sum(0)
            return self.total.unsqueeze(0)

    module = Replaces()
    host_total = module.total
    executor = wrap(module)
    with pytest.raises(
        poptorch.Error, match=r"Buffer total is reassigned .* Consider using self\.total\.copy_"
    ):
        executor.compile(torch.ones(1, 2))
    assert module.total is host_total
