"""``--kvplug-remote-kv URL``: a shared KV store under the host-memory tier (issue 30).

The URL may hold a Redis password, so it does not travel in ``ServerArgs`` as the other kvplug
choices do (``names``): SGLang logs every ``ServerArgs`` field, the radix-cache backend name
included. The launcher's argument hook (``cli_args``) puts it in the environment variable
``KVPLUG_SGLANG_REMOTE_KV`` of its own process, which SGLang's scheduler processes inherit, and
the radix-cache factory (``radix_backends``) reads it there. The model's identity in the store's
keys is SGLang's ``--served-model-name`` (its default: ``--model-path``).
"""

from __future__ import annotations

import os
from typing import Any, Mapping, MutableMapping, Optional

from kvplug.backend_factory import remote_kv_options
from kvplug.interface.kv_store import redact_url

ENV = "KVPLUG_SGLANG_REMOTE_KV"
FLAG = "--kvplug-remote-kv"


def check(url: str, prefix_cache: str, host_memory: Optional[int]) -> None:
    """Raise kvplug's ``InvalidArgumentError`` (the password redacted) when ``url`` cannot sit under
    prefix cache ``prefix_cache`` with ``host_memory`` bytes of host tier; kvplug's own rules."""
    options = {} if host_memory is None else {"host_memory": host_memory}
    remote_kv_options(prefix_cache, options, url, "model-checked-at-startup")


def publish(url: Optional[str], environ: MutableMapping[str, str] = os.environ) -> None:
    """Hand ``url`` to this process's children (SGLang's schedulers); ``None`` clears an inherited one."""
    # an environment variable, not a ServerArgs field: SGLang logs ServerArgs, never its environment
    if url is None:
        environ.pop(ENV, None)
    else:
        environ[ENV] = url


def published(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """The URL ``publish`` handed to this process, or ``None``."""
    return environ.get(ENV) or None


def model_id(server_args: Any) -> str:
    """The served model's name, the model's identity in the store's keys."""
    return str(getattr(server_args, "served_model_name", None) or getattr(server_args, "model_path", None) or "")


def shown(url: str) -> str:
    """``url`` as logs and errors may show it (``***@`` for credentials)."""
    return redact_url(url)


def redact_argv(argv: Any) -> None:
    """Replace the URL after ``--kvplug-remote-kv`` (or in ``--kvplug-remote-kv=URL``) in the list
    ``argv`` in place: SGLang keeps the command line it parsed (``ServerArgs.launch_command``,
    served by ``/server_info``) and ``sys.argv`` (its request dumps)."""
    if not isinstance(argv, list):
        return
    for index, arg in enumerate(argv):
        if not isinstance(arg, str):
            continue
        if arg == FLAG and index + 1 < len(argv) and isinstance(argv[index + 1], str):
            argv[index + 1] = shown(argv[index + 1])
        elif arg.startswith(FLAG + "="):
            argv[index] = f"{FLAG}={shown(arg[len(FLAG) + 1:])}"
