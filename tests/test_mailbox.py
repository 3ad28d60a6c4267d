"""The mailbox between a pipeline's workers: delivery, waiting for an emulated link, waking everyone on abort."""
import threading
import time

import pytest

from mpedu.runtime import Link
from mpedu.core import Aborted, Mailbox, mailbox as mailbox_module

SLACK = 0.15          # seconds a busy machine may add to a sleep-based delay (never subtracted)


def until(condition, seconds: float = 10.0) -> None:
    """Wait for `condition()`; fail (not hang) if it does not come."""
    deadline = time.perf_counter() + seconds
    while not condition():
        assert time.perf_counter() < deadline, "waited 10 s in vain"
        time.sleep(0.001)


def test_the_mailbox_delivers_after_the_link_time_without_blocking_the_sender():
    link = Link(0.03, 1e6)                                  # 30 ms + 20 kB at 1 MB/s = 50 ms
    mailbox = Mailbox(link)
    got = {}

    def receiver():
        got["value"] = mailbox.get("x")
        got["at"] = time.perf_counter()

    thread = threading.Thread(target=receiver)
    thread.start()
    sent = time.perf_counter()
    landing = mailbox.put("x", "tensor", ("vgpu:0", "vgpu:1"), 20_000)
    returned = time.perf_counter()
    thread.join()
    assert got["value"] == "tensor"
    assert landing - sent == pytest.approx(link.time(20_000), abs=5e-3)
    assert returned - sent < link.time(20_000) / 2           # the sender went on at once
    assert landing <= got["at"] <= landing + SLACK            # the receiver waited for the landing
    # the default link adds nothing: no landing time at all
    assert Mailbox().put("y", 1, ("vgpu:0", "vgpu:1"), 10**9) is None


def test_a_tensor_sent_before_its_receive_waits_in_the_mailbox():
    mailbox = Mailbox()
    assert mailbox.put(("act", 1, 0, 0), "early") is None    # shared memory: no landing time
    assert mailbox.get(("act", 1, 0, 0)) == "early"


@pytest.mark.parametrize("spin", [False, True])
def test_abort_wakes_a_waiting_receive_and_refuses_later_ones(spin):
    mailbox, raised = Mailbox(spin=spin), []

    def receiver():
        try:
            mailbox.get("never sent")
        except Aborted:
            raised.append(True)

    thread = threading.Thread(target=receiver)
    thread.start()
    until(lambda: mailbox._waiting)      # the receive is parked on its lock
    mailbox.abort()
    thread.join(timeout=10)
    assert raised == [True] and not thread.is_alive()
    with pytest.raises(Aborted):
        mailbox.get("after the abort")


def test_a_polling_receive_parks_after_its_window_and_a_send_still_wakes_it():
    mailbox, got = Mailbox(spin=True), []
    thread = threading.Thread(target=lambda: got.append(mailbox.get(("act", 1, 0, 0))))
    thread.start()
    until(lambda: mailbox._waiting)      # polled for SPIN_RECEIVE_S, found nothing, parked
    mailbox.put(("act", 1, 0, 0), "late")
    thread.join(timeout=10)
    assert got == ["late"] and not thread.is_alive()
    # a tensor already there is taken at once, without polling or parking
    mailbox.put(("grad", 0, 1, 0), "early")
    assert mailbox.get(("grad", 0, 1, 0)) == "early" and not mailbox._waiting


@pytest.mark.parametrize("ending", ["put", "abort"])
def test_a_send_or_an_abort_during_the_poll_ends_it_without_parking(monkeypatch, ending):
    monkeypatch.setattr(mailbox_module, "SPIN_RECEIVE_S", 30.0)     # a window long enough to act in
    mailbox, got = Mailbox(spin=True), []

    def receiver():
        try:
            got.append(mailbox.get("x"))
        except Aborted:
            got.append("aborted")

    thread = threading.Thread(target=receiver)
    thread.start()
    time.sleep(0.05)                                                   # the receive is polling now
    if ending == "put":
        mailbox.put("x", "tensor")
    else:
        mailbox.abort()
    thread.join(timeout=10)
    assert not thread.is_alive(), "the poll did not notice"
    assert got == (["tensor"] if ending == "put" else ["aborted"])
    assert not mailbox._waiting                                        # it never parked


def test_when_every_worker_waits_or_has_finished_the_mailbox_names_the_deadlock():
    mailbox = Mailbox(workers=3, describe=lambda key: f"tensor {key}")
    errors = []

    def receiver(key, who):
        try:
            mailbox.get(key, who)
        except Aborted:
            errors.append(key)

    threads = [threading.Thread(target=receiver, args=(k, w)) for k, w in (("a", "vgpu:0"), ("b", ("vgpu:1", "1F3")))]
    for t in threads:
        t.start()
    until(lambda: len(mailbox._waiting) == 2)
    assert mailbox.failure is None and not errors          # a third worker may still send
    mailbox.finished()                                      # ...it will not: no tensor can come
    for t in threads:
        t.join(10)
    assert sorted(errors) == ["a", "b"] and not any(t.is_alive() for t in threads)
    text = str(mailbox.failure)
    assert "deadlock" in text and "vgpu:0 waits for tensor a" in text and "vgpu:1 at 1F3 waits for tensor b" in text
    assert "1 of 3 devices had run all their actions" in text


def test_a_receive_that_will_be_answered_is_no_deadlock():
    mailbox = Mailbox(workers=2)
    got = []
    thread = threading.Thread(target=lambda: got.append(mailbox.get("x", "vgpu:1")))
    thread.start()
    until(lambda: "x" in mailbox._waiting)
    mailbox.put("x", 7)
    mailbox.finished()           # the sender is done, the receiver already has its tensor
    thread.join(10)
    assert got == [7] and mailbox.failure is None
