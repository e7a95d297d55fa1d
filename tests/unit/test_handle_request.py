"""The handle API's request parsing (deployments/serve/handle_api.py): what a caller passes
becomes a GenerateRequest, or a ValueError that says what is wrong."""

from __future__ import annotations

import pytest

from fairbatch.deployments.serve.handle_api import parse_request


def test_a_request_is_a_dict_or_keywords():
    assert parse_request({"prompt": "hi", "tenant": "a"}, {}).tenant == "a"
    assert parse_request(None, {"prompt": "hi", "max_tokens": 3}).max_tokens == 3
    merged = parse_request({"prompt": "hi", "max_tokens": 3}, {"max_tokens": 5})
    assert merged.max_tokens == 5  # keywords win over the dict's fields
    for bad in ("hello", ["prompt", "hi"], 7):
        with pytest.raises(ValueError, match="a generate request is a dict"):
            parse_request(bad, {})
    with pytest.raises(ValueError, match="invalid generate request"):
        parse_request({"prompt": "hi", "frobnicate": 1}, {})
