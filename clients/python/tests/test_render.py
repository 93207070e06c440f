"""{{name}} templating of task args, as agw does it."""

import pytest

from agq.worker import render


def test_placeholders_are_replaced_once_left_to_right() -> None:
    assert render("{{a}}-{{ b }}", {"a": "x", "b": "{{a}}"}) == "x-{{a}}"


def test_empty_and_unclosed_braces_stay_literal() -> None:
    assert render("{{}} {{a", {"a": "x"}) == "{{}} {{a"


def test_missing_variable_is_named() -> None:
    with pytest.raises(KeyError) as e:
        render("{{file}}", {})
    assert e.value.args[0] == "file"
