"""compare's JSON is strict: NaN and infinities become null, and read back as NaN."""

import json
import math

from multihead.train.compare_json import dumps, loss, strict


def test_non_finite_numbers_become_null_and_read_back_as_nan():
    value = {"val_loss": [2.5, math.nan], "curve": [[1, math.inf], (2, -math.inf)], "n": 3, "name": "mha"}
    text = dumps(value)
    back = json.loads(text)  # json.dumps(allow_nan=False) inside: a NaN left would raise
    assert back == {"val_loss": [2.5, None], "curve": [[1, None], [2, None]], "n": 3, "name": "mha"}
    assert strict(2.5) == 2.5 and loss(2.5) == 2.5 and math.isnan(loss(None))
