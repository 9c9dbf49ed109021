"""tsdev_runtime.distributed on two gloo ranks (separate processes): the collectives the model and the engine use."""
import pytest
import torch

from ranks import run_ranks
from tsdev_runtime import distributed

pytestmark = pytest.mark.slow  # spawns servers or rank processes (pytest -m 'not slow': the quick loop)


def collectives(ok_on_rank_1: bool):
    r = distributed.rank()
    summed = distributed.all_reduce(torch.full((3,), float(r + 1)))
    gathered = distributed.all_gather_last(torch.full((2, 2), float(r)))
    return dict(rank=r, size=distributed.size(), summed=summed.tolist(), gathered=gathered.tolist(),
                broadcast=distributed.broadcast({"from": r}), gather=distributed.gather(r * 10),
                agree=distributed.agree(r == 0 or ok_on_rank_1), shard=distributed.shard(8, "heads"),
                minimum=distributed.minimum(100 - r))


def test_two_ranks_reduce_gather_broadcast_and_agree_by_a_min():
    failed, fine = run_ranks(collectives, 2, False), run_ranks(collectives, 2, True)
    for rank, out in enumerate(failed):
        assert out["rank"] == rank and out["size"] == 2
        assert out["summed"] == [3.0] * 3 and out["gathered"] == [[0.0, 0.0, 1.0, 1.0]] * 2
        assert out["broadcast"] == {"from": 0} and out["gather"] == [0, 10]
        assert out["agree"] is False  # rank 1 failed: rank 0 must not go on either
        assert out["shard"] == (4 * rank, 4) and out["minimum"] == 99  # e.g. KV pages: what every rank can hold
    assert [out["agree"] for out in fine] == [True, True]


def test_a_rank_that_starts_later_than_the_rank_timeout_still_joins():
    """The rendezvous waits generously (a loaded machine imports torch slowly); --rank-timeout governs the calls
    after it."""
    out = run_ranks(collectives, 2, True, start_after=(0.0, 4.0), rank_timeout_s=1.0)
    assert [o["summed"] for o in out] == [[3.0] * 3] * 2 and [o["agree"] for o in out] == [True, True]


def test_one_process_is_rank_0_of_1_and_every_collective_is_the_identity():
    x = torch.randn(3)
    assert distributed.size() == 1 and distributed.rank() == 0
    assert distributed.all_reduce(x) is x and distributed.all_gather_last(x) is x
    assert distributed.agree(True) and not distributed.agree(False)
    assert distributed.broadcast("a") == "a" and distributed.gather(5) == [5]
    assert distributed.shard(8, "heads") == (0, 8) and distributed.minimum(7) == 7


def test_a_shape_that_does_not_divide_says_which_tp_to_choose(monkeypatch):
    monkeypatch.setattr(distributed, "size", lambda: 3)
    with pytest.raises(ValueError, match=r"key/value heads \(8\) does not divide by the tensor-parallel size 3"):
        distributed.shard(8, "key/value heads")
