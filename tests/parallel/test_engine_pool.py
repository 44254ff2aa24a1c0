"""The followers' KV pools: they must have as many blocks as rank 0's (its block tables index
theirs). A follower whose config leaves num_blocks unset takes rank 0's count (an unset count
is sized from the memory free in each process, which differs); one that sets another count is
refused by name, and rank 0 fails with ParallelError instead of hanging."""

from headwise.parallel import spawn

from . import ranks


def test_followers_without_a_pool_size_take_rank_0s():
    want = ranks.run(None, ["engine:llama-gqa"])["engine:llama-gqa"]["generate"]  # one process, unsharded
    lead, follower = spawn(ranks.engine_pool_sizes, 2, None, timeout_s=60, deadline_s=120)
    assert lead["blocks"] == 12 and lead["engine"] == want
    assert follower["steps"] > 0


def test_a_follower_with_another_pool_size_is_refused_by_name():
    lead, follower = spawn(ranks.engine_pool_sizes, 2, 10, timeout_s=10, deadline_s=120, raise_on_failure=False)
    assert not follower.ok
    assert "rank 0's KV pool has 12 blocks of 4 tokens, rank 1's config asks for 10 of 4" in follower.error
    assert lead.ok and lead.value["error"].startswith("ParallelError: rank 0 of 2"), lead.value
