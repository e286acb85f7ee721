"""An optimizer step that stops midway (Ctrl-C in a notebook, an error in an update), then a restore.

The step updates the states one sub-group after another, so an interrupt between two leaves some
sub-groups stepped and the others not. With the states in memory that was ignored: the next step
stepped the updated sub-groups a second time, silently. With the states on NVMe the store refused
every later step ("restore from a checkpoint"), and refused `zeroinf.load` as well, so no restore
was possible in the process. Now, on every tier (world 1, stage 3, the step after backward, small
sub-groups so the step has several): the next `step()`, `state_dict()` and `zeroinf.save` stop,
naming the interrupted step; `zero_grad()` does not; `zeroinf.load` of a checkpoint, or
`load_state_dict` of a state saved before, restores it, and the run then trains as the plain loop
(torch's fused AdamW) on the same batches, to 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import zeroinf
from tests.runtime.test_failed_backward import _assert_equal_runs, _batches, _loss, _net, _plain


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
        loss = _loss(model, x, y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    got = (losses, model.state_dict())
    opt.close()
    zeroinf.engine_of(model).close()
    _assert_equal_runs(got, _plain(clip=None), f"{tier} restored by {restore}")
