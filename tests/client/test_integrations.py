"""The DeepSpeed CheckpointEngine and the Hugging Face TrainerCallback adapters, through a real
daemon. DeepSpeed's engine is driven through its documented CheckpointEngine interface (the
calls engine.save_checkpoint / load_checkpoint make: create, save per file, commit, load), with
the real DeepSpeed objects' shapes (a LossScaler-like object, flat partitions). The callback's
resume inside a real Trainer: tests/client/test_hf_resume.py."""

from __future__ import annotations

import collections
import os
from types import SimpleNamespace

import pytest
import torch

from ucpd_client import Checkpointer
from ucpd_client.integrations.deepspeed import UcpdCheckpointEngine, use_ucpd
from ucpd_client.integrations.hf import UcpdCallback


Pair = collections.namedtuple("Pair", "a b")


class LossScalerLike:
    def __init__(self, scale):
        self.cur_scale, self.dynamic = scale, False


def ds_files(seed):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(84, generator=g)
    model = {"module": {"w": torch.randn(3, 4, generator=g).to(torch.bfloat16)}, "global_steps": seed,
             "param_shapes": [{"w": torch.Size([3, 4])}], "ds_version": "0.19.8"}
    optim = {"optimizer_state_dict": {"loss_scaler": LossScalerLike(2.0 ** seed),
                                      "base_optimizer_state": {"state": {0: {"exp_avg": flat * 2, "step": torch.tensor(3.0)}}},
                                      "single_partition_of_fp32_groups": [flat], "partition_count": [1]}}
    return {"mp_rank_00_model_states.pt": model, "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim}


def same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, LossScalerLike):
        return vars(a) == vars(b)
    return a == b


def test_deepspeed_checkpoint_engine_round_trip(daemon, tmp_path):
    with Checkpointer(daemon.run_dir, rank=0, world_size=1, embedded=False) as ckpt:
        engine = SimpleNamespace(_config=None)
        ce = use_ucpd(engine, ckpt, wait=True)
        assert engine.checkpoint_engine is ce and isinstance(ce, UcpdCheckpointEngine)
        for step in (10, 20):
            files = ds_files(step)
            info = SimpleNamespace(tag=f"global_step{step}", save_dir=str(tmp_path), save_latest=True)
            ce.create(info)
            for name, sd in files.items():
                ce.save(sd, os.path.join(tmp_path, info.tag, name))
            assert ce.commit(info) is True
            files[name]["optimizer_state_dict"]["single_partition_of_fp32_groups"][0].add_(1)  # after staging
        assert ckpt.latest() == 20
        assert not (tmp_path / "global_step10").exists()  # nothing written to disk
        for step in (10, 20):
            for name, want in ds_files(step).items():
                got = ce.load(os.path.join(tmp_path, f"global_step{step}", name), map_location="cpu")
                assert same(want, got), (step, name)
        with pytest.raises(Exception):
            ce.load(os.path.join(tmp_path, "global_step10", "no_such_file.pt"))
        torch.save({"x": 1}, tmp_path / "plain.pt")  # not in the daemon: read from disk
        assert ce.load(str(tmp_path / "plain.pt")) == {"x": 1}


def test_hf_callback_is_a_transformers_callback():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (optional)")
    assert isinstance(UcpdCallback(object(), every=3), transformers.TrainerCallback)


def test_the_integrations_name_tensors_by_the_state_names_rule_and_rebuild_every_container():
    """``state_names.skeleton``/``fill``, the walk DeepSpeed's engine and Lightning's IO share:
    tensors named as ``walk`` names them, containers (an OrderedDict, a named tuple) rebuilt."""
    import pickle

    from ucpd import state_names

    w, m, x = torch.ones(2), torch.zeros(3), torch.arange(4)
    state = {"model": collections.OrderedDict(w=w), "opt": [{"m": m}, 3], "pair": Pair(x, "k"), "a.b": w + 1,
             "a": {"b": w + 2}, "skeleton": m + 1, "plain": [1, 2], "empty": {}}
    skel, tensors = state_names.skeleton(state, lambda o: isinstance(o, torch.Tensor), reserved=("skeleton",))
    walked = [n for n, leaf, _, _ in state_names.walk(state, lambda o: isinstance(o, torch.Tensor))
              if isinstance(leaf, torch.Tensor)]
    assert sorted(tensors) == sorted(["model.w", "opt.0.m", "pair.0", "a.b", "a.b~", "skeleton~"])
    assert set(walked) | {"a.b~", "skeleton~"} == set(tensors) | {"skeleton"}
    assert state["model"]["w"] is w  # the state itself is left as it was
    back = state_names.fill(pickle.loads(pickle.dumps(skel)), tensors)
    assert type(back["model"]) is collections.OrderedDict and back["model"]["w"] is w
    assert type(back["pair"]) is Pair and back["pair"].a is x and back["pair"].b == "k"
    assert back["opt"][0]["m"] is m and back["opt"][1] == 3 and back["plain"] == [1, 2] and back["empty"] == {}
    assert {torch.equal(back["a.b"], w + 1), torch.equal(back["a"]["b"], w + 2), torch.equal(back["skeleton"], m + 1)} == {True}


def test_a_skeleton_pickled_before_state_names_still_loads():
    """DeepSpeed's old skeletons named tensors by index, Lightning's by name, both as ``_Ref``."""
    import pickle

    from ucpd import state_names
    from ucpd_client.integrations import deepspeed, lightning

    class _Old:
        def __init__(self, module, arg):
            self.module, self.arg = module, arg

        def __reduce__(self):
            return (getattr(self.module, "_Ref"), (self.arg,))

    t = torch.ones(2)
    ds = pickle.loads(pickle.dumps({"w": _Old(deepspeed, 0)}))
    assert state_names.fill(ds, {"0": t})["w"] is t
    lt = pickle.loads(pickle.dumps({"w": _Old(lightning, "state_dict.w")}))
    assert state_names.fill(lt, {"state_dict.w": t})["w"] is t
