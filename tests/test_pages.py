"""`loader_search.trial._pages`: a forked trial takes its data set's copy-on-write faults
before training, not during its first epoch (issue 27: the num_workers=0 reading)."""

from __future__ import annotations

import json
import os
import resource
import sys
import types

import pytest

from loader_search.trial._pages import own_pages

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="copy-on-write needs fork")


class Samples:
    """A data set as the built-in ones hold theirs: a list of encoded samples."""

    def __init__(self, n: int) -> None:
        self.images = [os.urandom(3000) for _ in range(n)]  # about one page each
        self.labels = list(range(n))
        self.helper = json.dumps  # a function: not data, never walked into
        self.module = sys  # nor a module


def _faults_of_a_read_pass(data: Samples, own_first: bool) -> int:
    """Minor page faults a forked child takes while it reads every sample once (after
    `own_pages` when ``own_first``)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, leave without running any finaliser
        try:
            if own_first:
                own_pages(data)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            total = 0
            for image in data.images:  # what a num_workers=0 epoch does to each sample
                total += len(image)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            os.write(writer, str(faults).encode())
        finally:
            os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as answer:
        text = answer.read()
    os.waitpid(pid, 0)
    return int(text)


def test_a_forked_reader_takes_its_copy_on_write_faults_before_the_read_pass() -> None:
    data = Samples(4000)
    plain = _faults_of_a_read_pass(data, own_first=False)
    owned = _faults_of_a_read_pass(data, own_first=True)
    # Every sample's page is written (its reference count) and copied: ~one fault each.
    assert plain >= 1000, plain
    assert owned <= plain / 20, (owned, plain)


def test_the_walk_visits_the_samples_and_stops_at_code_and_its_bounds() -> None:
    data = Samples(100)
    visited = own_pages(data)
    # The object, its attribute dict, two lists, 100 bytes, the small ints (shared), but
    # neither json.dumps nor sys nor anything behind them (thousands of objects).
    assert 100 + 3 <= visited < 400, visited
    assert own_pages(types.SimpleNamespace(f=own_pages, m=sys)) <= 3
    assert own_pages(data, max_objects=10) <= 10 + 1
