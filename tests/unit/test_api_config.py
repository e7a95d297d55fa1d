"""App config validation and the ingress tenant registry (no torch, no ray, no HTTP)."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest

from fairbatch.deployments.api.config import AppConfig, ConfigError, load_config, parse_config
from fairbatch.deployments.api.tenants import AuthError, Rejected, TenantRegistry


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_default_config_is_anonymous_and_tiny():
    cfg = parse_config(None)
    assert cfg == AppConfig()
    assert cfg.allow_anonymous and cfg.model == "tiny" and cfg.model_name == "fairbatch-tiny"
    assert cfg.tenants == [] and cfg.admin_api_key_sha256 is None
    reg = TenantRegistry(cfg)
    assert reg.authenticate(None).name == "default"
    assert reg.authenticate("Bearer EMPTY").name == "default"
    with pytest.raises(AuthError):
        reg.authenticate("Bearer some-unknown-key")


def test_plain_keys_are_hashed_and_never_kept():
    cfg = parse_config(
        {"tenants": [{"name": "a", "api_key": "secret-a"}], "admin_api_key": "secret-admin"}
    )
    t = cfg.tenants[0]
    assert t.api_key is None and t.api_key_sha256 == digest("secret-a")
    assert cfg.admin_api_key is None and cfg.admin_api_key_sha256 == digest("secret-admin")
    dumped = repr(cfg) + str(cfg.model_dump())
    assert "secret-a" not in dumped and "secret-admin" not in dumped


def test_yaml_config_loads(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(
        "args:\n"
        "  served_model_name: my-model\n"
        "  allow_anonymous: false\n"
        "  admin_api_key_sha256: " + digest("adm").upper() + "\n"
        "  tenants:\n"
        "    - {name: gold, api_key: k1, weight: 4, priority: 2, tokens_per_minute: 6000}\n"
        "    - {name: free, api_key_sha256: " + digest("k2") + "}\n"
        "  limits: {max_body_bytes: 65536, max_requests_per_tenant: 8}\n"
    )
    cfg = load_config(path)
    assert cfg.model_name == "my-model" and not cfg.allow_anonymous
    assert [t.name for t in cfg.tenants] == ["gold", "free"]
    assert cfg.tenants[0].weight == 4.0 and cfg.tenants[0].tokens_per_minute == 6000
    assert cfg.admin_api_key_sha256 == digest("adm")  # normalized to lower case
    assert cfg.limits.max_requests_per_tenant == 8
    reg = TenantRegistry(cfg)
    assert reg.authenticate("Bearer k2").name == "free"
    assert reg.is_admin("Bearer adm") and not reg.is_admin("Bearer k1")
    with pytest.raises(AuthError):
        reg.authenticate(None)  # anonymous access is off


BAD_CONFIGS = [
    ("tenants:\n  - {name: a, weight: -1}\n", "tenants.0.weight"),
    (
        "tenants:\n  - {name: a}\n  - {name: b, tokens_per_minute: 0}\n",
        "tenants.1.tokens_per_minute",
    ),
    ("tenants:\n  - {name: a, wieght: 2}\n", "tenants.0.wieght"),
    ("tenats: []\n", "tenats"),
    ("tenants:\n  - {weight: 2}\n", "tenants.0.name"),
    ("tenants:\n  - {name: a}\n  - {name: a}\n", "duplicate tenant name"),
    ("tenants:\n  - {name: a, api_key: x}\n  - {name: b, api_key: x}\n", "same API key"),
    (
        "tenants:\n  - {name: a, api_key: x, api_key_sha256: '" + "0" * 64 + "'}\n",
        "tenants.0: give",
    ),
    ("tenants:\n  - {name: a, api_key_sha256: abc}\n", "tenants.0.api_key_sha256"),
    ("tenants:\n  - {name: 'has space'}\n", "tenants.0.name"),
    ("limits: {max_body_bytes: 10}\n", "limits.max_body_bytes"),
    ("limits: {max_requests_total: 0}\n", "limits.max_requests_total"),
    ("allow_anonymous: maybe\n", "allow_anonymous"),
    ("tenants: 3\n", "tenants"),
    ("- just\n- a list\n", "must be a mapping"),
    ("tenants: [\n", "not valid YAML"),
]


@pytest.mark.parametrize("text,needle", BAD_CONFIGS)
def test_bad_yaml_names_the_field(tmp_path, text, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert needle in str(e.value) and str(path) in str(e.value)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def registry(clock=None, **limits):
    cfg = parse_config(
        {
            "tenants": [
                {"name": "a", "api_key": "ka", "tokens_per_minute": 60},
                {"name": "b", "api_key": "kb", "max_requests": 2},
            ],
            "allow_anonymous": False,
            "limits": {"max_requests_per_tenant": 1, "max_requests_total": 3, **limits},
        }
    )
    return TenantRegistry(cfg, clock or Clock())


def test_auth_header_forms():
    reg = registry()
    assert reg.authenticate("Bearer ka").name == "a"
    assert reg.authenticate("bearer   kb ").name == "b"
    for bad in (None, "Bearer ", "Bearer kx", "Basic ka", "ka"):
        with pytest.raises(AuthError):
            reg.authenticate(bad)
    assert not reg.is_admin("Bearer ka")  # no admin key configured
    assert not reg.admin_enabled


def test_quota_bucket_charges_and_retry_after():
    clock = Clock()
    reg = registry(clock)
    a = reg.tenants["a"]
    t = reg.admit(a, "r1", prompt_tokens=50, created=0)
    t.charge(20)  # 70 charged against a 60-token bucket: 10 in debt
    reg.release(t)
    with pytest.raises(Rejected) as e:
        reg.admit(a, "r2", 1, 0)
    assert (e.value.status, e.value.code) == (429, "quota_exceeded")
    assert e.value.retry_after == 10  # 10 tokens at 1 token/s
    clock.t = 10.0
    with pytest.raises(Rejected):  # exactly refilled to 0: not yet positive
        reg.admit(a, "r2", 1, 0)
    clock.t = 10.5
    reg.release(reg.admit(a, "r2", 1, 0))
    assert a.tokens_charged == 71 and a.requests_rejected == 2


def test_in_flight_bounds_per_tenant_and_global():
    reg = registry()
    a, b = reg.tenants["a"], reg.tenants["b"]
    ta = reg.admit(a, "a1", 1, 0)
    with pytest.raises(Rejected) as e:
        reg.admit(a, "a2", 1, 0)  # the default per-tenant bound is 1
    assert (e.value.status, e.value.code) == (429, "tenant_queue_full")
    tb = [reg.admit(b, f"b{i}", 1, 0) for i in range(2)]  # b's own bound is 2
    with pytest.raises(Rejected) as e:
        reg.admit(b, "b3", 1, 0)
    assert e.value.status == 429
    reg.update("b", max_requests=5)
    with pytest.raises(Rejected) as e:
        reg.admit(b, "b3", 1, 0)  # now the global bound (3) is what refuses it
    assert (e.value.status, e.value.code) == (503, "server_busy") and e.value.retry_after >= 1
    reg.release(ta)
    reg.release(ta)  # idempotent
    assert reg.total_in_flight == 2 and a.in_flight == 0
    for t in tb:
        reg.release(t)
    assert reg.total_in_flight == 0 and not reg.requests


def test_requests_are_bound_to_their_tenant():
    reg = registry()
    t = reg.admit(reg.tenants["a"], "secret-id", 1, 0)
    assert reg.lookup(reg.tenants["a"], "secret-id") is t
    assert reg.lookup(reg.tenants["b"], "secret-id") is None
    assert reg.lookup(reg.tenants["a"], "other") is None


def test_admin_update_changes_quota_and_keeps_debt():
    clock = Clock()
    reg = registry(clock)
    a = reg.tenants["a"]
    reg.release(reg.admit(a, "r", 90, 0))  # 30 in debt
    reg.update("a", weight=3.0, priority=5, tokens_per_minute=120)
    assert (a.weight, a.priority, a.tokens_per_minute) == (3.0, 5, 120)
    with pytest.raises(Rejected) as e:
        reg.admit(a, "r2", 1, 0)
    assert e.value.retry_after == 15  # the debt stays; it refills at 2 tokens/s now
    reg.update("a", clear_quota=True)
    reg.release(reg.admit(a, "r2", 1, 0))
    assert a.bucket is None and a.public()["tokens_per_minute"] is None
    assert "key" not in str(a.public())
    with pytest.raises(KeyError):
        reg.update("nobody", weight=1.0)


def test_config_and_registry_import_neither_torch_nor_ray():
    code = (
        "import sys; import fairbatch.deployments.api.config, fairbatch.deployments.api.tenants, "
        "fairbatch.deployments.api.schemas; "
        "print([m for m in ('torch', 'ray') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_prefix_cache_groups_salt_members_alike_and_no_one_else():
    cfg = parse_config(
        {
            "tenants": [
                {"name": "a", "api_key": "ka", "prefix_cache_group": "team-1"},
                {"name": "b", "api_key": "kb", "prefix_cache_group": "team-1"},
                {"name": "c", "api_key": "kc"},
                # a group named like a tenant still gets a salt of its own
                {"name": "d", "api_key": "kd", "prefix_cache_group": "c"},
            ],
            "allow_anonymous": True,
        }
    )
    reg = TenantRegistry(cfg)
    salts = {n: t.cache_salt for n, t in reg.tenants.items()}
    assert salts == {
        "a": "group:team-1",
        "b": "group:team-1",
        "c": None,  # the engine salts with the tenant's name
        "d": "group:c",
        "default": None,  # the anonymous tenant shares with nobody
    }
    assert all(":" not in n for n in reg.tenants)  # so no group salt equals a tenant name
    assert reg.tenants["a"].public()["prefix_cache_group"] == "team-1"


@pytest.mark.parametrize("group", ["", "has space", "x:y", "a/b", "g" * 65, 7])
def test_bad_prefix_cache_group_names_the_field(group):
    with pytest.raises(ConfigError) as e:
        parse_config({"tenants": [{"name": "a", "prefix_cache_group": group}]})
    assert "tenants.0.prefix_cache_group" in str(e.value)
