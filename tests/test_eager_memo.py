"""`EagerMemo`: a decode step's memo is kept between eager steps, remade when its key or buffer changes, never kept
by a traced step, and empty in a copy."""

import copy
import pickle

import torch

from hf_kvplus.storage.eager_memo import EagerMemo


def counting():
    calls = []

    def make(x):
        calls.append(x)
        return len(calls)

    return calls, make


def test_kept_until_the_key_changes():
    memo, (calls, make) = EagerMemo(), counting()
    assert memo.get((2, 3), make, "a") == 1
    assert memo.get((2, 3), make, "b") == 1  # kept
    assert memo.get((2, 4), make, "c") == 2
    assert calls == ["a", "c"]


def test_a_new_buffer_remakes_even_with_equal_key():
    memo, (calls, make) = EagerMemo(), counting()
    buffer = torch.zeros(4)
    memo.get("k", make, 1, anchor=buffer)
    memo.get("k", make, 2, anchor=buffer)
    memo.get("k", make, 3, anchor=torch.zeros(4))  # same shape, another tensor
    assert calls == [1, 3]


def test_the_buffer_is_held_weakly():
    memo, (_, make) = EagerMemo(), counting()
    buffer = torch.zeros(4)
    memo.get("k", make, 1, anchor=buffer)
    del buffer
    calls, make = counting()
    memo.get("k", make, 2, anchor=torch.zeros(4))
    assert calls == [2]


def test_a_traced_step_makes_its_value_and_keeps_nothing():
    memo = EagerMemo()
    compiled = torch.compile(lambda x: memo.get((), lambda: x + 1), backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.zeros(2)), torch.ones(2))
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))  # made again, not the first call's
    calls, make = counting()
    assert memo.get((), make, "eager") == 1 and calls == ["eager"]  # the traced calls kept nothing


def test_copies_start_empty():
    memo, (calls, make) = EagerMemo(), counting()
    memo.get("k", make, 1, anchor=torch.zeros(1))
    for copied in (copy.deepcopy(memo), pickle.loads(pickle.dumps(memo))):
        copied.get("k", make, 2)
    assert calls == [1, 2, 2]
