"""`elasticd certs` and the checks of TLS bundles (elastic.security.certs, .tls)."""

from __future__ import annotations

import datetime
import os
import shutil
import stat
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from elastic.security import certs
from elastic.security.identity import Role, identity_of
from elastic.security.tls import TLSError, TLSFiles, load

NOW = datetime.datetime(2026, 11, 23, 12, 0, tzinfo=datetime.timezone.utc)


@pytest.fixture
def ca(tmp_path):
    return certs.create_ca(tmp_path / "ca", now=NOW)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_bundles_name_their_holder_and_keep_keys_private(ca):
    host = certs.issue(ca, Role.HOST, "host-3", now=NOW)
    controller = certs.issue(ca, Role.CONTROLLER, "host0", sans=("10.0.0.5", "head.example"),
                             now=NOW)
    assert host.directory == ca / "hosts" / "host-3"
    assert controller.directory == ca / "controller"
    for directory in (ca, host.directory, controller.directory):
        assert mode(directory) == 0o700
    for key in (ca / "ca.key", host.directory / "key.pem", controller.directory / "key.pem"):
        assert mode(key) == 0o600
    leaf = x509.load_pem_x509_certificate((host.directory / "cert.pem").read_bytes())
    assert identity_of(leaf).role is Role.HOST and identity_of(leaf).name == "host-3"
    usage = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # a host serves only its own port, under a name that is not the controller's
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    host_sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert host_sans.get_values_for_type(x509.DNSName) == [certs.HOST_SERVER_NAME,
                                                           "host-3.elastic-host"]
    from elastic.agent.service import can_serve

    operator = certs.issue(ca, Role.OPERATOR, "alice", now=NOW)
    assert can_serve(TLSFiles.in_dir(host.directory))
    assert not can_serve(TLSFiles.in_dir(operator.directory))  # (as old host certificates)
    server = x509.load_pem_x509_certificate((controller.directory / "cert.pem").read_bytes())
    sans = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == [certs.CONTROLLER_SERVER_NAME,
                                                      "head.example"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["10.0.0.5"]
    checked = load(TLSFiles.in_dir(host.directory), (Role.HOST,), now=NOW)
    assert checked.identity.name == "host-3"


@pytest.mark.parametrize("call, message", [
    (lambda ca: certs.create_ca(ca), "already exists; a CA is never overwritten"),
    (lambda ca: certs.issue(ca, Role.HOST, "../etc", now=NOW), "host name '../etc' is not valid"),
    (lambda ca: certs.issue(ca, Role.HOST, "h\n1", now=NOW), "is not valid"),
    (lambda ca: certs.issue(ca, Role.HOST, "h", sans=("x",), now=NOW),
     "--san applies to controller certificates only"),
    (lambda ca: certs.issue(ca, Role.HOST, "h", days=4000, now=NOW), "would outlive the CA"),
    (lambda ca: certs.issue(ca, Role.HOST, "h", days=0, now=NOW), "--days must be at least 1"),
    (lambda ca: certs.issue(ca.parent / "nothing", Role.HOST, "h", now=NOW),
     "run `elasticd certs init"),
])
def test_bad_requests_are_refused_with_a_reason(ca, call, message):
    with pytest.raises(certs.CertError, match=message.replace("(", r"\(").replace("[", r"\[")):
        call(ca)


def test_loading_checks_chain_key_role_expiry_and_key_mode(ca, tmp_path):
    host = certs.issue(ca, Role.HOST, "h1", now=NOW).directory
    files = TLSFiles.in_dir(host)
    with pytest.raises(TLSError, match="is a host certificate .* needs a controller"):
        load(files, (Role.CONTROLLER,), now=NOW)
    with pytest.raises(TLSError, match="expired on"):
        load(files, (Role.HOST,), now=NOW + datetime.timedelta(days=400))
    with pytest.raises(TLSError, match="not valid before"):
        load(files, (Role.HOST,), now=NOW - datetime.timedelta(days=1))
    other = certs.create_ca(tmp_path / "other", now=NOW)
    with pytest.raises(TLSError, match="was not issued by the CA"):
        load(TLSFiles(other / "ca.pem", files.cert, files.key), (Role.HOST,), now=NOW)
    second = certs.issue(ca, Role.HOST, "h2", now=NOW).directory
    with pytest.raises(TLSError, match="is not the key of the certificate"):
        load(TLSFiles(files.ca, files.cert, second / "key.pem"), (Role.HOST,), now=NOW)
    os.chmod(files.key, 0o644)
    with pytest.raises(TLSError, match=r"accessible to other users \(mode 0644\); chmod 600"):
        load(files, (Role.HOST,), now=NOW)


def test_cert_manager_layout_and_missing_files(ca, tmp_path):
    host = certs.issue(ca, Role.HOST, "h1", now=NOW).directory
    secret = tmp_path / "secret"
    secret.mkdir()
    for src, dst in (("ca.pem", "ca.crt"), ("cert.pem", "tls.crt"), ("key.pem", "tls.key")):
        shutil.copy(host / src, secret / dst)
    assert load(TLSFiles.in_dir(secret), (Role.HOST,), now=NOW).identity.name == "h1"
    (secret / "tls.key").unlink()
    with pytest.raises(TLSError, match="has no key.pem or tls.key"):
        TLSFiles.in_dir(secret)
    with pytest.raises(TLSError, match="pass --insecure"):
        TLSFiles.in_dir(tmp_path / "absent")


def test_certs_command_line(tmp_path, proc_env):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "elastic.cli", "certs", *args],
                              env=proc_env, capture_output=True, text=True, timeout=60)

    root = str(tmp_path / "pki")
    assert run("init", "--dir", root).returncode == 0
    issued = run("issue", "--dir", root, "--role", "host", "--name", "host-7")
    assert issued.returncode == 0 and "host certificate for host-7" in issued.stdout
    checked = run("check", "--tls-dir", f"{root}/hosts/host-7")
    assert checked.returncode == 0 and "host host-7, valid until" in checked.stdout
    again = run("init", "--dir", root)
    assert again.returncode == 2 and again.stderr.count("\n") == 1
    assert "already exists" in again.stderr and "Traceback" not in again.stderr
    bad = run("issue", "--dir", root, "--role", "host", "--name", "a/b")
    assert bad.returncode == 2 and "is not valid" in bad.stderr
