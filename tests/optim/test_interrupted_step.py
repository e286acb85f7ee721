"""An optimizer step that stops midway (Ctrl-C in a notebook, an error in an update), then a restore.

The step updates the states one sub-group after another, so an interrupt between two leaves some
sub-groups stepped and the others not. With the states in memory that was ignored: the next step
stepped the updated sub-groups a second time, silently. With the states on NVMe the store refused
every later step ("restore from a checkpoint"), and refused `zeroinf.load` as well, so no restore
was possible in the process. Now, on every tier (world 1, stage 3, the step after backward, small
sub-groups so the step has several): the next `step()`, `state_dict()` and `zeroinf.save` stop,
naming the interrupted step; `zero_grad()` does not; `zeroinf.load` of a checkpoint, or
`load_state_dict` of a state saved before, restores it, and the run then trains as the plain loop
(torch's fused AdamW) on the same batches, to 1e-6. Everything on NVMe, a Ctrl-C inside each of the
first 49 disk waits of a step (forward, backward, the step inside it and after it), a load of the
checkpoint from before: the same, and every staging buffer given back.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

import zeroinf
from tests._harness import run_ranks
from tests.runtime.test_failed_backward import (
    _assert_equal_runs,
    _batches,
    _closed_run,
    _loss,
    _net,
    _plain,
    _train_step,
)
from zeroinf.aio.engine import AioHandle
from zeroinf.runtime import interrupts


def _interrupt_the_third_update(opt: Any) -> None:
    """The next step raises KeyboardInterrupt before its third sub-group's update (two are done)."""
    make_update, calls = opt._update_fn, [0]

    def interrupting(*args: Any, **kwargs: Any) -> Any:
        update = make_update(*args, **kwargs)

        def run(staged: Any) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise KeyboardInterrupt("interrupted on purpose")
            update(staged)

        return run

    opt._update_fn = interrupting


@pytest.mark.parametrize("restore", ["zeroinf.load", "load_state_dict"])
@pytest.mark.parametrize("tier", ["device", "host", "nvme"])
def test_an_interrupted_step_is_refused_until_restored(tier: str, restore: str, tmp_path: Path) -> None:
    offload: dict[str, Any] = {"step_in_backward": False, "sub_group_numel": 600}
    if tier != "device":
        offload.update(params=tier, optimizer=tier, nvme_dir=str(tmp_path))
    cfg = zeroinf.Config(stage=3, persist_threshold_bytes=0, unit_classes=["Block"], offload=offload)
    model = zeroinf.shard(_net(), cfg)
    opt = zeroinf.AdamW(model, lr=1e-2)
    losses = []
    for step, (x, y) in enumerate(_batches()):
        if step == 2:
            saved = opt.state_dict() if restore == "load_state_dict" else None
            if saved is None:
                zeroinf.save(tmp_path / "ckpt", model, opt, step=2)
            opt.backward(_loss(model, x, y))
            make_update = opt._update_fn
            _interrupt_the_third_update(opt)
            with pytest.raises(KeyboardInterrupt):
                opt.step()
            opt._update_fn = make_update
            opt.zero_grad()  # dropping gradients is fine
            opt.backward(_loss(model, x, y))
            inconsistent = r"inconsistent.*interrupted on purpose.*restore from a checkpoint \(zeroinf\.load"
            save = lambda: zeroinf.save(tmp_path / "no", model, opt, step=9)  # noqa: E731
            for call in (opt.step, opt.state_dict, save):
                with pytest.raises(RuntimeError, match=inconsistent):
                    call()
            assert not (tmp_path / "no").exists()
            opt.zero_grad()
            if saved is None:  # the model's weights come back with the optimizer's states
                zeroinf.load(tmp_path / "ckpt", model, opt)
            else:  # the masters come back, and the parameters from them
                opt.load_state_dict(saved)
        _train_step(model, opt, x, y, losses)
    got = _closed_run(model, opt, losses)
    _assert_equal_runs(got, _plain(clip=None), f"{tier} restored by {restore}")


def _resume(model: Any, opt: Any, checkpoint: str | Path) -> None:
    """What a loop does after a Ctrl-C: drop the gradients (refused where the model is partly
    stepped, which the load then repairs), load the checkpoint from before the step."""
    try:
        opt.zero_grad()
    except RuntimeError as exc:
        assert "partly updated" in str(exc)
    zeroinf.load(checkpoint, model, opt)
    opt.zero_grad()


def _assert_staging_all_back(model: Any, case: str) -> None:
    engine = zeroinf.engine_of(model)
    assert engine.param_files is not None
    engine.param_files.drain()
    assert engine.param_files.pools.all_free, f"{case}: a staging buffer was never given back"


def _interrupt_wait(monkeypatch: pytest.MonkeyPatch, at: int) -> list[int]:
    """The `at`-th NVMe wait from now raises KeyboardInterrupt (a Ctrl-C while it blocks)."""
    real, count = AioHandle.wait, [0]

    def wait(self: AioHandle, *args: Any, **kwargs: Any) -> int:
        count[0] += 1
        if count[0] == at:
            raise KeyboardInterrupt("interrupted on purpose")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AioHandle, "wait", wait)
    return count


def test_an_interrupt_inside_any_nvme_wait_of_a_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Everything on NVMe, the default step inside backward: a Ctrl-C inside the n-th disk wait of
    step 2 (forward, backward, the step inside it, the step after it), for n across the step; the loop
    catches it, calls `zero_grad()` (refused when units were stepped: the model is partly updated),
    loads the checkpoint taken before the step and trains on: the plain loop's losses and weights.
    Waits that were interrupted used to drop their staging buffer (a write popped from its queue before
    the wait): the pool ran dry a few writes later (BufferPoolTimeout after `io_timeout_s`)."""
    want = _plain(clip=None)
    interrupted = 0
    for at in range(1, 50):
        folder = tmp_path / str(at)
        offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": str(folder), "sub_group_numel": 600,
                   "io_timeout_s": 10.0}
        model = zeroinf.shard(_net(), zeroinf.Config(stage=3, persist_threshold_bytes=0, unit_classes=["Block"],
                                                     offload=offload))
        opt = zeroinf.AdamW(model, lr=1e-2)
        losses = []
        for step, (x, y) in enumerate(_batches()):
            if step == 2:
                zeroinf.save(folder / "ckpt", model, opt, step=2)
                with monkeypatch.context() as patch:
                    _interrupt_wait(patch, at)
                    try:
                        loss = _loss(model, x, y)
                        opt.backward(loss)
                        opt.step()
                    except KeyboardInterrupt:
                        interrupted += 1
                    else:  # the step has fewer waits than `at`
                        opt.zero_grad()
                        losses.append(loss.item())
                        continue
                _resume(model, opt, folder / "ckpt")
            _train_step(model, opt, x, y, losses)
        _assert_staging_all_back(model, f"interrupt at wait {at}")
        _assert_equal_runs(_closed_run(model, opt, losses), want, f"interrupt at NVMe wait {at}")
    assert interrupted >= 30, "the step should have more waits than most of the points tried"


def _sigint_at_line(source: str, at: int) -> Any:
    """A `sys.settrace` function sending this process SIGINT (what Ctrl-C sends) at the `at`-th line
    executed in files under `source`."""
    lines = [0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(source):
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                lines[0] += 1
                if lines[0] == at:
                    signal.raise_signal(signal.SIGINT)
            return line

        return line

    return trace


def _ctrl_c_sweep(rank: int, world: int, folder: str, points: list[int]) -> list[tuple[int, str]]:
    """In a process of its own (its main thread, Python's default SIGINT handler): for each n, a fresh
    run whose step 2 gets a real SIGINT at the n-th line of zeroinf's code it executes."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts._state.installed = False  # the fork server's handler is not the default: install again
    want = _plain(clip=None)
    source = str(Path(zeroinf.__file__).parent) + os.sep
    outcomes = []
    for at in points:
        offload = {"params": "nvme", "optimizer": "nvme", "nvme_dir": f"{folder}/{at}", "sub_group_numel": 600,
                   "io_timeout_s": 10.0}
        model = zeroinf.shard(_net(), zeroinf.Config(stage=3, persist_threshold_bytes=0, unit_classes=["Block"],
                                                     offload=offload))
        opt = zeroinf.AdamW(model, lr=1e-2)
        losses, outcome = [], "not reached"
        for step, (x, y) in enumerate(_batches()):
            if step == 2:
                zeroinf.save(f"{folder}/{at}/ckpt", model, opt, step=2)
                sys.settrace(_sigint_at_line(source, at))
                try:
                    loss = _loss(model, x, y)
                    opt.backward(loss)
                    opt.step()
                except KeyboardInterrupt:
                    outcome = "interrupted"
                finally:
                    sys.settrace(None)
                if outcome != "interrupted":
                    losses.append(loss.item())
                    opt.zero_grad()
                    continue
                _resume(model, opt, f"{folder}/{at}/ckpt")
            _train_step(model, opt, x, y, losses)
        _assert_staging_all_back(model, f"Ctrl-C at line {at}")
        _assert_equal_runs(_closed_run(model, opt, losses), want, f"Ctrl-C at line {at}")
        outcomes.append((at, outcome))
    return outcomes


def test_ctrl_c_anywhere_in_an_nvme_step_then_a_load_trains_on(tmp_path: Path) -> None:
    """runtime/interrupts.py [Note: Ctrl-C inside the engine]: a SIGINT at sampled lines across a
    step with everything on NVMe (forward, backward, the step inside it): the KeyboardInterrupt comes
    out where the engine's state is whole; `zeroinf.load` of the checkpoint from before the step, and
    the run trains as the plain loop, every staging buffer back. Before, 4 of 43 such points ended in
    BufferPoolTimeout after `io_timeout_s` or an assertion (raising at the line itself, which the
    deferral now prevents, or, with the deferral alone, prefetched shards of the cut forward holding
    the buffers the load writes through)."""
    points = list(range(1, 9000, 560))
    (outcomes,) = run_ranks(_ctrl_c_sweep, 1, str(tmp_path), points, timeout_s=600)
    assert [at for at, _ in outcomes] == points
    assert sum(outcome == "interrupted" for _, outcome in outcomes) >= 12, outcomes


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_load_while_a_step_inside_backward_waits_for_step(tier: str, tmp_path: Path) -> None:
    """A backward stepped units inside it (offload.step_in_backward) and the loop then went wrong
    (a second backward refused, `model.zero_grad()` refused) instead of calling `step()`: that step
    still held staging buffers, and `zeroinf.load` waited 30 s for them and failed
    (BufferPoolTimeout; found by a random draw of optimizer lifecycles). The load now drops the
    waiting step (every state is rewritten), and the run goes on as one that loaded the checkpoint
    afresh, bitwise."""
    import torch

    from tests._parity import build_model, global_batch, train_rank_slices

    def make(sub: str) -> tuple[torch.nn.Module, Any]:
        offload = {"optimizer": tier, "step_in_backward": True, "sub_group_numel": 2048}
        if tier == "nvme":
            offload["nvme_dir"] = str(tmp_path / sub)
            (tmp_path / sub).mkdir()
        model = zeroinf.shard(build_model(), zeroinf.Config(stage=2, offload=offload))
        return model, zeroinf.AdamW(model, lr=1e-3)

    model, opt = make("a")
    train_rank_slices(model, opt, 0, 1, 0, 2)
    zeroinf.save(tmp_path / "ckpt", model, opt, step=2)
    model(*global_batch(5)).backward()  # steps units inside it; no step() follows
    with pytest.raises(RuntimeError, match="already stepped units inside it"):
        model.zero_grad()
    with pytest.raises(RuntimeError, match="backward pass 2 since the last optimizer step"):
        opt.backward(model(*global_batch(6)))
    zeroinf.load(tmp_path / "ckpt", model, opt)
    model.zero_grad()
    resumed = train_rank_slices(model, opt, 0, 1, 2, 4)
    fresh_model, fresh_opt = make("b")
    zeroinf.load(tmp_path / "ckpt", fresh_model, fresh_opt)
    assert resumed == train_rank_slices(fresh_model, fresh_opt, 0, 1, 2, 4)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values(),
                                                 strict=True))
