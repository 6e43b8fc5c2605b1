"""TLS on `aserve serve`'s listening socket, with vLLM's (uvicorn's) flags: --ssl-certfile (a PEM certificate chain,
holding the key too unless --ssl-keyfile names it), --ssl-keyfile, --ssl-ca-certs (the CAs that client certificates
are checked against), --ssl-cert-reqs (ssl.CERT_NONE 0: no client certificate, 1: optional, 2: required) and
--ssl-ciphers (OpenSSL's cipher list, TLS 1.2 and below). The files are read once, at start-up, before the model
loads: a bad one fails at once."""

from __future__ import annotations

import argparse
import ssl


def add_tls_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--ssl-certfile", default=None,
                       help="serve HTTPS with this PEM certificate chain (its key too, unless "
                            "--ssl-keyfile)")  # fmt: skip
    serve.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    serve.add_argument("--ssl-ca-certs", default=None,
                       help="CA certificates (PEM) that client certificates are checked against")  # fmt: skip
    serve.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE),
                       help="client certificates: 0 none asked for, 1 optional, 2 required (ssl.CERT_*)")  # fmt: skip
    serve.add_argument("--ssl-ciphers", default=None, help="OpenSSL cipher list for TLS 1.2 and below")
    serve.add_argument("--enable-ssl-refresh", action="store_true",
                       help="refused: certificates are read once, at start-up (restart to load new ones)")  # fmt: skip


def ssl_context(ns: argparse.Namespace) -> ssl.SSLContext | None:
    """The server's TLS context from the flags, or None (plain HTTP); ValueError naming the flag that is wrong."""
    if ns.enable_ssl_refresh:
        raise ValueError("--enable-ssl-refresh: aserve reads its certificates once, at start-up; restart it to load "
                         "new ones")  # fmt: skip
    if ns.ssl_certfile is None:
        given = [flag for flag, value in (("--ssl-keyfile", ns.ssl_keyfile), ("--ssl-ca-certs", ns.ssl_ca_certs),
                                          ("--ssl-ciphers", ns.ssl_ciphers)) if value is not None]  # fmt: skip
        if given or ns.ssl_cert_reqs != ssl.CERT_NONE:
            raise ValueError(f"{(given or ['--ssl-cert-reqs'])[0]} needs --ssl-certfile (the server's certificate)")
        return None
    if ns.ssl_cert_reqs not in (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED):
        raise ValueError(f"--ssl-cert-reqs must be 0 (none), 1 (optional) or 2 (required), got {ns.ssl_cert_reqs}")
    if ns.ssl_cert_reqs != ssl.CERT_NONE and ns.ssl_ca_certs is None:
        raise ValueError("--ssl-cert-reqs checks client certificates against --ssl-ca-certs: give it")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(ns.ssl_certfile, ns.ssl_keyfile)
        context.verify_mode = ssl.VerifyMode(ns.ssl_cert_reqs)
        if ns.ssl_ca_certs is not None:
            context.load_verify_locations(ns.ssl_ca_certs)
        if ns.ssl_ciphers is not None:
            context.set_ciphers(ns.ssl_ciphers)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"TLS (--ssl-certfile {ns.ssl_certfile}, --ssl-keyfile {ns.ssl_keyfile}, --ssl-ca-certs "
                         f"{ns.ssl_ca_certs}, --ssl-ciphers {ns.ssl_ciphers}): {e}") from None  # fmt: skip
    return context
