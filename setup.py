"""Packaging for twisted-relay."""

import re
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent
VERSION = re.search(
    r'^__version__ = "([^"]+)"',
    (HERE / "twisted_relay" / "_version.py").read_text(),
    re.M,
).group(1)

setup(
    name="twisted-relay",
    version=VERSION,
    description=(
        "A relay for the Anthropic Messages API, on Twisted, that keeps long "
        "tool-use sessions alive when an upstream reuses tool-use ids."
    ),
    long_description=(HERE / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="MIT",
    python_requires=">=3.10",
    # twisted/plugins is a namespace directory, not a package (no __init__.py),
    # so find_packages() cannot see it; list it explicitly.
    packages=find_packages(include=["twisted_relay", "twisted_relay.*"])
    + ["twisted.plugins"],
    # An explicit root makes an editable install (PEP 660) add this folder
    # to sys.path with a plain .pth file instead of an import hook, so that
    # Twisted's plugin scan finds twisted/plugins here too.
    package_dir={"": "."},
    package_data={"twisted.plugins": ["*.py"]},
    include_package_data=True,
    zip_safe=False,
    install_requires=[
        # [tls]: pyOpenSSL and service_identity, for https upstreams (the default).
        # 25.5: the first release whose Site can be told not to parse form
        # bodies (parsePOSTFormSubmission); .ci/run tests this floor.
        "twisted[tls]>=25.5",
        "treq>=23.11",
        "klein>=23.5",
        "ujson>=5.8",
        "prometheus_client>=0.17",
        # --config files are TOML: tomllib is in the standard library from 3.11.
        'tomli>=1.1; python_version < "3.11"',
    ],
    extras_require={
        # --thread-store redis://...: a Twisted-native Redis client.
        "redis": ["txredisapi>=1.6"],
        # --usage-db postgresql://...: the usage ledger in PostgreSQL (psycopg 3).
        "postgres": ["psycopg[binary]>=3.2"],
        # The Google login (Claude on Vertex AI): google-auth and its requests
        # transport. Tested from google-auth 2.23.4 (older ones pin urllib3<2)
        # and requests 2.31.
        "gcp": ["google-auth>=2.23.4", "requests>=2.31"],
        # An AWS login reading the standard credential chain (environment,
        # shared files, SSO, web identity, container and instance metadata);
        # keys from named environment variables and SigV4 signing need none.
        # The simulated Bedrock checks signatures with it. Tested on 1.29.0,
        # 1.31.0 and 1.44.8.
        "aws": ["botocore>=1.29"],
        # Microsoft Foundry with Entra ID tokens (login "azure"). 1.19 is the
        # oldest tested; with 1.16 the refresh tests of tests/test_logins_azure.py
        # fail (a refresh did not reach the identity endpoint, and requests were
        # refused once the token expired).
        "azure": ["azure-identity>=1.19"],
        # Sign-in with the company's identity provider (docs/signin.md): ID
        # tokens checked and session tokens signed with joserfc, PKCE helpers
        # from authlib. Tested on joserfc 1.0.0 and 1.8.0, authlib 1.3.0 and
        # 1.9.10.
        "signin": ["joserfc>=1.0", "authlib>=1.3"],
        # The telemetry intake's protobuf encoding (OTLP/HTTP application/x-protobuf,
        # signin/telemetry.py); JSON exports need nothing. Tested on 1.27.0 (with
        # protobuf 4.25.9) and 1.45.2 (protobuf 7.36.2).
        "telemetry": ["opentelemetry-proto>=1.27"],
        "test": [
            "hypothesis>=6.90",
            # its message threads (tests of twisted_relay.message_threads.model);
            # [bedrock]: AnthropicBedrock signs with boto3/botocore; [vertex]:
            # AnthropicVertex; the oracles of the simulated clouds.
            "anthropic[bedrock,vertex]>=2.16",
            "boto3>=1.35",  # the bedrock-runtime client (InvokeModel, CountTokens)
            "txredisapi>=1.6",
            "psycopg[binary]>=3.2",
            "google-auth>=2.23.4",
            "requests>=2.31",
            # the simulated token endpoint's test service-account keys
            # (Twisted's [tls] extra brings it too).
            "cryptography>=41",
            # botocore: the AWS logins' chain, the reference SigV4 signer the
            # relay's is tested against, its event-stream decoder (the oracle of
            # tests/test_eventstream.py).
            "botocore>=1.35",
            "azure-identity>=1.19",  # the azure login against the simulated identity endpoint
            # its types check the shapes the request translations write and the
            # Responses and Chat Completions events the answer translations read
            # (tests/test_openai_requests.py, tests/test_openai_answers.py).
            "openai>=3.63",
            # [signin]; authlib's OAuth2Session (requests) is the oracle of the
            # simulated identity provider (tests/test_simulated_idp.py).
            "joserfc>=1.0",
            "authlib>=1.3",
            # the telemetry intake's protobuf exports, and its tests' collector stand-in
            "opentelemetry-proto>=1.27",
        ],
    },
    entry_points={
        "console_scripts": [
            "twisted-relay-simulated = twisted_relay.simulated.cli:main",
            "twisted-relay-demo = twisted_relay.demo:main",
            "twisted-relay-replay = twisted_relay.replay:main",
            "twisted-relay-usage = twisted_relay.ledger_report:main",
        ],
    },
    classifiers=[
        "Framework :: Twisted",
        "Programming Language :: Python :: 3",
        "License :: OSI Approved :: MIT License",
    ],
)
