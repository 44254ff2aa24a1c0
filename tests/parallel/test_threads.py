"""Each tensor-parallel rank on one machine takes its share of the cores (cores // N torch threads,
as torch reports it in the rank), or fewer where the caller asks for fewer: N ranks never run more
threads than the machine has cores."""

import os

import torch

from headwise.parallel import spawn


def rank_threads(comm):
    """In a rank: what torch runs here, and what the governor fits before a step."""
    from headwise.runtime.threads import fit_threads

    counts = torch.get_num_threads(), fit_threads()
    comm.all_reduce(torch.zeros(1), "the ranks' end")  # no rank leaves the group before the other joined it
    return counts


def test_ranks_share_the_cores():
    cores = len(os.sched_getaffinity(0))
    share = max(1, cores // 2)
    for asked, expected in ((None, share), (64, share), (1, 1)):
        for started, fitted in spawn(rank_threads, 2, threads=asked, timeout_s=60, deadline_s=120):
            assert started == expected and 1 <= fitted <= expected
