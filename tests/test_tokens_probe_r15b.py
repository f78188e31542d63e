"""A bool among a list's token ids is refused, naming it (review R15: numpy read ``[1, True]``
as ``[1, 1]``, so ``match_prefix([1, True])`` answered for another prompt)."""

import numpy as np
import pytest
import torch

from tiercache.keys import _token_array
from tiercache.live.arguments import flat_token_ids


@pytest.mark.parametrize("tokens", [[1, True], (5, np.True_), [[1, 2, False]], [3, torch.tensor(True)]])
def test_a_bool_among_listed_token_ids_is_refused_naming_it_and_its_position(tokens):
    with pytest.raises(TypeError, match=r"tokens: token_ids must be integers, got the bool .* at position"):
        flat_token_ids(tokens, "tokens")
    with pytest.raises(TypeError, match="got the bool"):
        _token_array(tokens if not isinstance(tokens[0], list) else tokens[0])


def test_integer_lists_rows_and_per_step_tensors_are_still_taken():
    assert flat_token_ids([1, 2], "t").tolist() == [1, 2]
    assert flat_token_ids([[1, 2]], "t").tolist() == [1, 2]
    assert flat_token_ids([np.int64(3), 4], "t").tolist() == [3, 4]
    assert flat_token_ids([torch.tensor([3]), torch.tensor([4])], "t").tolist() == [3, 4]
    assert _token_array(np.array([7, 8])).tolist() == [7, 8]


@pytest.mark.parametrize("ids", [np.ones((1, 3)), torch.ones(1, 3), [[1.0, 2.0, 3.0]]])
def test_a_float_input_ids_row_is_refused_naming_the_shape_given(ids):
    """Review R42-5: the message named the row's shape (3,), not the [1, n] given."""
    with pytest.raises(TypeError, match=r"^t: token_ids must be a 1-D sequence of integers, got dtype float\d+ shape \(1, 3\)$"):
        flat_token_ids(ids, "t")
