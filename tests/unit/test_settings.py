"""Settings: the class, env.sample and the README's table agree; validation refuses bad values."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from fastpubsub.exceptions import ConfigurationError
from fastpubsub.settings import Settings, is_loopback

ROOT = Path(__file__).resolve().parents[2]
TEST_ONLY = {"FASTPUBSUB_TEST_DATABASE_URL", "FASTPUBSUB_TEST_POSTGRES_IMAGE", "FASTPUBSUB_TEST_SCRATCH"}


def shown(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def defaults() -> dict[str, str]:
    return {
        f"FASTPUBSUB_{name.upper()}": shown(field.default) for name, field in Settings.model_fields.items()
    }


def env_sample() -> dict[str, str]:
    entries = {}
    for line in (ROOT / "env.sample").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            entries[key] = value
    return entries


def readme_table() -> dict[str, str]:
    rows = re.findall(
        r"^\| `(FASTPUBSUB_[A-Z0-9_]+)` \| (`[^`]*`|\(empty\)) \|", (ROOT / "README.md").read_text(), re.M
    )
    return {name: "" if default == "(empty)" else default.strip("`") for name, default in rows}


def test_env_sample_lists_every_setting_with_its_default() -> None:
    sample = env_sample()
    assert set(sample) - TEST_ONLY == set(defaults())
    assert {k: v for k, v in sample.items() if k not in TEST_ONLY} == defaults()


def test_readme_documents_every_setting_with_its_default() -> None:
    assert readme_table() == defaults()


def test_every_setting_the_code_reads_is_a_field() -> None:
    mentioned = set()
    for path in (ROOT / "fastpubsub").rglob("*.py"):
        mentioned |= set(re.findall(r"FASTPUBSUB_[A-Z0-9_]+", path.read_text()))
    # FASTPUBSUB_TEST_ itself: the prefix of the test-only ones, which the command line passes over.
    assert mentioned - set(defaults()) - TEST_ONLY - {"FASTPUBSUB_TEST_"} == set()


def test_empty_values_mean_unset() -> None:
    settings = Settings(_env_file=None, database_url="", auth_secret_key="  ", jdbc_jar="")
    assert (settings.database_url, settings.auth_secret_key, settings.jdbc_jar) == (None, None, None)


@pytest.mark.parametrize(
    "values",
    [
        {"subscription_backoff_min_seconds": 10, "subscription_backoff_max_seconds": 5},
        {"api_port": 0},
        {"log_level": "loud"},
        {"auth_algorithm": "none"},
        {"database_pool_size": 0},
        {"auth_client_cache_seconds": 6},
    ],
)
def test_invalid_settings_are_refused(values: dict) -> None:
    with pytest.raises(ValidationError):
        Settings(_env_file=None, **values)


@pytest.mark.parametrize(
    ("algorithm", "key", "ok"),
    [
        ("HS256", "k" * 32, True),
        ("HS256", "k" * 31, False),
        ("HS512", "k" * 63, False),
        ("HS512", "k" * 64, True),
        ("HS256", "changeme", False),
    ],
)
def test_signing_keys_must_be_long_enough(algorithm: str, key: str, ok: bool) -> None:
    settings = Settings(_env_file=None, auth_algorithm=algorithm, auth_secret_key=key)
    if ok:
        assert settings.require_auth_secret() == key
    else:
        with pytest.raises(ConfigurationError):
            settings.require_auth_secret()


@pytest.mark.parametrize(
    "key",
    [
        "CHANGE-ME-use-fastpubsub-generate-secret-key",
        "changeme-" + "k" * 40,
        "k" * 40 + "ChangeMe",
        "this-is-an-EXAMPLE-signing-key-0123456789abcdef",
        "placeholder-" + "0" * 40,
    ],
)
def test_placeholder_signing_keys_are_refused(key: str) -> None:
    assert len(key) >= 32  # long enough: refused for what it says, not for its length
    settings = Settings(_env_file=None, auth_enabled=True, auth_secret_key=key)
    with pytest.raises(ConfigurationError, match=r"example value.*generate-secret-key"):
        settings.require_auth_secret()


def test_the_kubernetes_example_secret_is_refused() -> None:
    import yaml

    documents = yaml.safe_load_all((ROOT / "deploy/kubernetes/secret.example.yaml").read_text())
    (secret,) = [doc for doc in documents if doc["kind"] == "Secret"]
    key = secret["stringData"]["FASTPUBSUB_AUTH_SECRET_KEY"]
    settings = Settings(_env_file=None, auth_enabled=True, auth_secret_key=key)
    with pytest.raises(ConfigurationError, match="example value"):
        settings.require_auth_secret()


def test_generated_keys_are_accepted() -> None:
    from fastpubsub.auth import generate_signing_key

    for algorithm in ("HS256", "HS384", "HS512"):
        key = generate_signing_key()
        settings = Settings(_env_file=None, auth_algorithm=algorithm, auth_secret_key=key)
        assert settings.require_auth_secret() == key


def test_cors_origins_are_split() -> None:
    assert Settings(_env_file=None, api_cors_origins="http://a, http://b,").cors_origins == [
        "http://a",
        "http://b",
    ]


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.1.2.3", True),
        ("::1", True),
        ("[::1]", True),
        ("localhost", True),
        ("LOCALHOST", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.1", False),
        ("192.0.2.10", False),
        ("example.com", False),
        ("localhost.example.com", False),
        ("", False),
    ],
)
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_auth_off_is_refused_only_where_others_can_reach() -> None:
    off = Settings(_env_file=None)
    assert off.api_host == "127.0.0.1"
    assert off.exposure_problem("127.0.0.1") is None
    assert "0.0.0.0 is not a loopback address" in (off.exposure_problem("0.0.0.0") or "")
    told = Settings(_env_file=None, api_insecure_no_auth=True)
    assert told.exposure_problem("0.0.0.0") is None
    on = Settings(_env_file=None, auth_enabled=True)
    assert on.exposure_problem("0.0.0.0") is None


def test_invalid_settings_are_described_by_variable_with_credentials_never_shown() -> None:
    from pydantic import BaseModel

    from fastpubsub.settings import describe_invalid

    class Fields(BaseModel):
        api_port: int
        database_url: int
        archive_uri: int
        api_client_secret: int
        auth_secret_key: int
        log_level: int

    with pytest.raises(ValidationError) as invalid:
        Fields.model_validate(
            {
                "api_port": "abc",
                "database_url": "postgresql://u:hunter2@db/x",
                "archive_uri": "s3://key:hunter2@bucket",
                "api_client_secret": "hunter2",
                "auth_secret_key": "hunter2",
                "log_level": "two\nlines",
            }
        )
    text = describe_invalid(invalid.value)
    assert "hunter2" not in text
    assert "\n" not in text
    assert text.startswith("FASTPUBSUB_API_PORT=abc: Input should be a valid integer")
    for name in ("FASTPUBSUB_DATABASE_URL: ", "FASTPUBSUB_ARCHIVE_URI: ", "FASTPUBSUB_API_CLIENT_SECRET: "):
        assert name in text
    assert "FASTPUBSUB_LOG_LEVEL=two lines: " in text


@pytest.mark.parametrize(
    "entry", ["127.0.0.1/33", "127.0.0.0/8x", "http://127.0.0.1:8080", "a..b", "*.internal"]
)
def test_push_allowed_hosts_refuses_what_would_match_no_host(entry: str) -> None:
    """A typo in FASTPUBSUB_PUSH_ALLOWED_HOSTS stops the start, naming the entry (it was taken for a name)."""
    with pytest.raises(ValidationError, match=re.escape(repr(entry))):
        Settings(_env_file=None, push_allowed_hosts=f"localhost, {entry}")


def test_push_allowed_hosts_takes_names_addresses_and_networks() -> None:
    from fastpubsub.push.endpoints import EndpointPolicy

    settings = Settings(
        _env_file=None, push_allowed_hosts="hooks.internal, my_host, 10.0.0.0/8, [::1], 127.0.0.1"
    )
    policy = EndpointPolicy.from_settings(False, settings.push_allowed_hosts)
    assert policy.allowed_names == {"hooks.internal", "my_host"}
    assert [str(n) for n in policy.allowed_networks] == ["10.0.0.0/8", "::1/128", "127.0.0.1/32"]
