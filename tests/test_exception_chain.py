"""found_in_chain: the exception of a kind behind another, through causes and contexts."""

from __future__ import annotations

import pickle

from dapo.exception_chain import found_in_chain


def _raised(make) -> BaseException:
    try:
        make()
    except BaseException as e:  # noqa: BLE001 - the test builds chains of any kind
        return e
    raise AssertionError("nothing raised")


def test_the_exception_itself_its_cause_and_its_context():
    stop = KeyboardInterrupt()
    assert found_in_chain(stop, KeyboardInterrupt) is stop

    def caused():
        raise RuntimeError("internal assert") from stop

    assert found_in_chain(_raised(caused), KeyboardInterrupt) is stop

    def while_handling():
        try:
            raise stop
        except KeyboardInterrupt:
            raise RuntimeError("clean-up failed") from None  # context kept, cause None

    assert found_in_chain(_raised(while_handling), KeyboardInterrupt) is stop
    assert found_in_chain(RuntimeError("alone"), KeyboardInterrupt) is None
    assert found_in_chain(None, KeyboardInterrupt) is None


def test_a_context_behind_a_cause_is_found_and_the_cause_comes_first():
    refused, other = pickle.UnpicklingError("refused"), pickle.UnpicklingError("other")
    outer = OSError("could not load")
    outer.__cause__ = ValueError("wrapped")
    outer.__cause__.__context__ = refused
    outer.__context__ = other
    assert found_in_chain(outer, pickle.UnpicklingError) is refused
    outer.__cause__ = None
    assert found_in_chain(outer, pickle.UnpicklingError) is other


def test_a_chain_that_loops_is_walked_once():
    a, b = ValueError("a"), ValueError("b")
    a.__context__, b.__context__ = b, a
    assert found_in_chain(a, KeyboardInterrupt) is None
    assert found_in_chain(a, ValueError) is a
