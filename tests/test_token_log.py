"""glm53.model.token_log.TokenLog: the array stays equal to the list under every list mutation, and
appends convert only what was appended."""
from __future__ import annotations

import random

import numpy as np
import pytest

from glm53.model.kv_state import KVState
from glm53.model.token_log import TokenLog


def mutations(rng: random.Random):
    """(name, function of a list) covering every mutating list method and operator."""
    def ints(n):
        return [rng.randrange(0, 1 << 40) for _ in range(n)]
    return [
        ("append", lambda x: x.append(ints(1)[0])),
        ("extend", lambda x: x.extend(ints(rng.randint(0, 9)))),
        ("iadd", lambda x: x.__iadd__(ints(3))),
        ("del tail", lambda x: x.__delitem__(slice(rng.randint(0, len(x)), None))),
        ("del item", lambda x: x and x.__delitem__(rng.randrange(-len(x), len(x)))),
        ("del stepped", lambda x: x.__delitem__(slice(None, None, 3))),
        ("set item", lambda x: x and x.__setitem__(rng.randrange(-len(x), len(x)), ints(1)[0])),
        ("set slice", lambda x: x.__setitem__(slice(rng.randint(0, len(x)), None), ints(2))),
        ("set stepped", lambda x: x.__setitem__(slice(None, None, 2), ints(len(x[::2])))),
        ("insert", lambda x: x.insert(rng.randint(-3, len(x) + 3), ints(1)[0])),
        ("pop", lambda x: x and x.pop()),
        ("pop at", lambda x: x and x.pop(rng.randrange(len(x)))),
        ("remove", lambda x: x and x.remove(rng.choice(x))),
        ("sort", lambda x: x.sort()),
        ("reverse", lambda x: x.reverse()),
        ("imul", lambda x: x.__imul__(rng.choice([0, 1, 2]) if len(x) < 50 else 1)),
        ("clear", lambda x: rng.random() < 0.1 and x.clear()),
    ]


@pytest.mark.parametrize("seed", range(5))
def test_array_equals_the_list_after_any_mutations(seed):
    rng = random.Random(seed)
    log, ref = TokenLog(), []
    ops = mutations(rng)
    for step in range(600):
        name, op = rng.choice(ops)
        state = rng.getstate()
        op(log)
        rng.setstate(state)
        op(ref)
        assert list(log) == ref, name
        if rng.random() < 0.5:  # the array read at random points: validity must survive between reads
            arr = log.array()
            assert arr.dtype == np.int64 and np.array_equal(arr, np.array(ref, dtype=np.int64)), (step, name)


def test_appends_convert_only_the_new_ids():
    log = TokenLog(range(1000))
    log.array()
    base = log._arr
    log.extend(range(1000, 1010))
    list.__setitem__(log, 3, -1)  # behind the log's back: not seen, which shows only appends were converted
    arr = log.array()
    assert arr[3] == 3 and arr[-1] == 1009 and log._arr is base  # grown in place, prefix not reconverted
    with pytest.raises(ValueError):
        arr[0] = 5  # read-only: callers cannot corrupt the log's copy


def test_kv_state_keeps_a_token_log():
    state = KVState(n_layers=1, latent_dim=4, index_dim=4, indexed_layers=frozenset(), tokens=[1, 2, 3])
    assert isinstance(state.tokens, TokenLog) and state.token_ids().tolist() == [1, 2, 3]
    state.tokens.extend([4, 5])
    state.truncate(2)
    state.tokens.append(9)
    assert state.token_ids().tolist() == [1, 2, 9]
    state.tokens = [7, 8]  # a plain list assigned later: converted in full, still right
    assert state.token_ids().tolist() == [7, 8]
