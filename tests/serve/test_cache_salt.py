"""`cache_salt` separates tenants: different salts never share cached KV, equal salts do, and
requests without a salt share the common namespace."""

from __future__ import annotations

from serve_helpers import user_message


def cached_tokens(client, content: str, salt: str | None) -> int:
    extra = {} if salt is None else {"cache_salt": salt}
    reply = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=2,
        extra_body=extra,
    )
    return reply.usage.prompt_tokens_details.cached_tokens


def test_salts_isolate_tenants(server) -> None:
    client = server.client(max_retries=0)
    content = user_message(4242, n=40)  # a prompt long enough to span several blocks
    assert cached_tokens(client, content, "tenant-a") == 0
    assert cached_tokens(client, content, "tenant-b") == 0  # another tenant: nothing shared
    assert cached_tokens(client, content, "tenant-a") > 30  # the same tenant: shared
    assert cached_tokens(client, content, None) < 4  # no salt: the shared namespace, apart
    assert cached_tokens(client, content, None) > 30
