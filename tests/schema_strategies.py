"""Hypothesis strategies for JSON schemas whose every instance is bounded (numbers with bounds,
strings with a maximum length or a bounded pattern, arrays with maxItems, closed objects): a
model constrained by one always reaches the schema's end, so each reply can be validated."""

from __future__ import annotations

from hypothesis import strategies as st

_names = st.text(alphabet="abcdefghij_", min_size=1, max_size=6)
_bounds = st.tuples(st.integers(-1000, 1000), st.integers(0, 1000)).map(
    lambda t: (t[0], t[0] + t[1])
)
_leaves = st.one_of(
    _bounds.map(lambda b: {"type": "integer", "minimum": b[0], "maximum": b[1]}),
    _bounds.map(lambda b: {"type": "number", "minimum": b[0], "maximum": b[1]}),
    st.tuples(st.integers(0, 4), st.integers(0, 8)).map(
        lambda t: {"type": "string", "minLength": t[0], "maxLength": t[0] + t[1]}
    ),
    st.sampled_from(["^[a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$", "^(red|green|blue)$", "^x?y{2}$"]).map(
        lambda p: {"type": "string", "pattern": p}
    ),
    st.lists(
        st.one_of(st.text("abc xyz\"'", max_size=5), st.integers(-5, 5), st.none()),
        min_size=1,
        max_size=4,
        unique_by=lambda v: (type(v), v),
    ).map(lambda e: {"enum": e}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
)


def _object(props: dict, required: list[str]) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": [name for name in required if name in props],
        "additionalProperties": False,
    }


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    arrays = st.tuples(children, st.integers(0, 2), st.integers(0, 3)).map(
        lambda t: {"type": "array", "items": t[0], "minItems": t[1], "maxItems": t[1] + t[2]}
    )
    objects = st.builds(
        _object,
        st.dictionaries(_names, children, min_size=1, max_size=4),
        st.lists(_names, unique=True),  # a schema lists each required name once
    )
    return arrays | objects


SCHEMAS = st.recursive(_leaves, _containers, max_leaves=6)
