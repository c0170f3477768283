"""Egress policies, the connection log and brokered credentials through the
Python SDK, against a real server (no internet needed: denied names never
leave the node)."""

import time

import pytest

import dsec


def _log_has(sb, pred, timeout_s=5.0):
    end = time.time() + timeout_s
    while True:
        log = sb.network_log()
        if any(pred(r) for r in log.records) or time.time() > end:
            return log
        time.sleep(0.1)


def test_a_policy_is_created_read_changed_and_logged(client):
    policy = dsec.NetworkPolicy(allow=["mirror.example", "*.mirror.example", "203.0.113.0/24"], deny=["evil.example"])
    with client.create("busybox", ttl_s=600, network_policy=policy) as sb:
        nw = sb.network()
        assert nw.mode == "egress"
        assert nw.policy == policy
        assert sb.refresh().raw["spec"]["network"]["policy"]["rules"][0] == {"action": "allow", "destination": "mirror.example"}

        sb.exec("nslookup evil.example; nslookup elsewhere.example", timeout_s=30)
        log = _log_has(sb, lambda r: r.host == "elsewhere.example")
        denied = {r.host: r for r in log.records if r.protocol == "dns" and not r.allowed}
        assert denied["evil.example"].reason == "deny evil.example"
        assert denied["elsewhere.example"].reason == "no rule"
        assert log.next_seq == log.records[-1].seq
        assert sb.network_log(after_seq=log.next_seq).records == []

        # The rollout phase: nothing; then unrestricted again.
        assert sb.set_network_policy(dsec.NetworkPolicy()).policy == dsec.NetworkPolicy()
        assert sb.network().policy == dsec.NetworkPolicy()
        assert sb.set_network_policy(None).policy is None
        assert sb.set_network_policy({"allow": ["*"]}).policy.allow == ["*"]


def test_a_sandbox_without_egress_takes_no_policy(client):
    with client.create("busybox", ttl_s=600) as sb:
        assert sb.network().mode == "none"
        with pytest.raises(dsec.InvalidRequest):
            sb.set_network_policy(dsec.NetworkPolicy())
    with pytest.raises(ValueError):
        client.create("busybox", network="none", network_policy=dsec.NetworkPolicy())
    with pytest.raises(ValueError):
        client.create("busybox", network_policy={"allowed": ["x"]})


def test_a_bad_rule_is_invalid(client):
    for rule in ("not a name!", "2001:db8::/32", "*.*.example"):
        with pytest.raises(dsec.InvalidRequest):
            client.create("busybox", ttl_s=60, network_policy=dsec.NetworkPolicy(allow=[rule]))


def test_a_brokered_credentials_value_never_comes_back(client):
    secret = "sk-python-sdk-0123456789abcdef"
    cred = dsec.Credential(host="api.example", header="X-Api-Key", value=secret)
    with client.create("busybox", ttl_s=600, network_policy=dsec.NetworkPolicy(credentials=[cred])) as sb:
        nw = sb.network()
        assert nw.policy.credentials == [dsec.Credential(host="api.example", header="X-Api-Key")]
        assert secret not in repr(sb.refresh().raw) and secret not in repr(client.list())
        assert secret not in sb.exec("env; cat /etc/resolv.conf").output
    with pytest.raises(dsec.InvalidRequest):
        client.create("busybox", ttl_s=60, network_policy={"credentials": [{"name": "no-such-credential"}]})

