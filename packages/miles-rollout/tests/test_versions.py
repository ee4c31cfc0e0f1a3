"""The weight-version bookkeeping both engines share (`miles_rollout.engines.versions`)."""

import pytest

from miles_rollout.engines.versions import WeightVersions


def test_a_push_checked_later_keeps_what_it_replaced_until_rolled_back():
    versions: WeightVersions[str] = WeightVersions()
    versions.begin(check_later=True)
    assert versions.keeps_previous
    versions.took(1, "copy of 0")
    versions.done()
    assert versions.version == 1
    assert versions.roll_back("test engine") == (0, "copy of 0")
    assert versions.version == 0
    with pytest.raises(RuntimeError, match="test engine: no previous version is kept"):
        versions.roll_back("test engine")


def test_a_push_checked_at_once_or_whose_check_passed_keeps_nothing():
    versions: WeightVersions[str] = WeightVersions()
    versions.begin(check_later=False)
    assert not versions.keeps_previous
    versions.took(1, "copy of 0")
    versions.done()
    with pytest.raises(RuntimeError, match="no previous version"):
        versions.roll_back("e")
    versions.begin(check_later=True)
    versions.took(2, "copy of 1")
    versions.done()
    versions.drop_previous()
    with pytest.raises(RuntimeError, match="no previous version"):
        versions.roll_back("e")
    assert versions.version == 2


def test_a_push_that_fails_goes_back_to_the_version_held_before_it():
    versions: WeightVersions[str] = WeightVersions()
    versions.begin(check_later=True)
    versions.took(1, "copy of 0")
    versions.done()
    versions.begin(check_later=False)  # the next push drops what the last one kept
    assert versions.failed() is None and versions.version == 1  # it broke off before taking its version
    versions.begin(check_later=False)
    versions.took(2, "copy of 1")
    assert versions.failed() == "copy of 1" and versions.version == 1  # taken, then its check failed
    with pytest.raises(RuntimeError, match="no previous version"):
        versions.roll_back("e")
