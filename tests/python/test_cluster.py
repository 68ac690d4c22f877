"""remotehead.cluster: how a trainer process finds the data-parallel processes it belongs to, and
what that changes in RemoteHead (the processes themselves: test_data_parallel.py)."""

import pytest
import torch

import remotehead
from remotehead.cluster import Cluster, detect


def test_rank_and_world_size_come_from_torchruns_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert detect() == Cluster(0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert detect() == Cluster(3, 4)
    assert detect().distributed and not detect().is_main


@pytest.mark.parametrize("rank,world", [("4", "4"), ("-1", "2"), ("x", "2"), ("0", "0")])
def test_a_bad_environment_is_refused_naming_it(monkeypatch, rank, world):
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match="RANK / WORLD_SIZE"):
        detect()


def test_every_rank_keeps_its_own_gradient_identity(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    assert Cluster(0, 1).rank_trainer("mine") == "mine"
    assert Cluster(0, 1).rank_trainer(None).startswith("py-")
    assert Cluster(1, 2).rank_trainer("mine") == "mine/rank-1"
    assert Cluster(1, 2).rank_trainer("mine/rank-1") == "mine/rank-1"
    assert Cluster(1, 2).rank_trainer(None) == "job-7/rank-1"
    # Two ranks never share an identity (the second's micro-batches would be dropped).
    assert len({Cluster(r, 4).rank_trainer("mine") for r in range(4)}) == 4


def test_remote_head_among_several_ranks(server_target):
    with remotehead.Client(server_target) as client:
        client.create_head("cluster-head", 11, 4)
        head = remotehead.RemoteHead(client, "cluster-head", trainer="t",
                                     cluster=Cluster(1, 2))
        assert head.trainer == "t/rank-1"
        weight = torch.nn.Parameter(torch.zeros(11, 4))
        with pytest.raises(remotehead.InvalidArgumentError, match="local_weight: expected none"):
            remotehead.RemoteHead(client, "cluster-head", local_weight=weight,
                                  cluster=Cluster(0, 2))
        client.drop_head("cluster-head")
