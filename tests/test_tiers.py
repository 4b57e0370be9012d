"""The suite's two tiers: tests/extended.txt's entries mark tests and cases `extended`."""

from conftest import extended_nodes

NODES = ["test_a.py::test_x[one]", "test_a.py::test_x[two]", "test_a.py::test_y",
         "test_b.py::test_z[1]"]


def test_an_entry_names_a_whole_test_or_one_case():
    marked, stale = extended_nodes({"test_a.py::test_x[two]", "test_b.py::test_z"}, NODES, [])
    assert marked == {"test_a.py::test_x[two]", "test_b.py::test_z[1]"} and stale == []


def test_an_entry_naming_no_case_of_a_collected_test_is_stale():
    entries = {"test_a.py::test_x[three]", "test_a.py::test_gone", "test_c.py::test_w[1]"}
    marked, stale = extended_nodes(entries, NODES, [])
    # test_c.py was not collected (a run of other files): its entry is not judged.
    assert marked == set() and stale == ["test_a.py::test_gone", "test_a.py::test_x[three]"]
    # An argument picking tests by name leaves the module's others uncollected.
    assert extended_nodes(entries, NODES[:1], ["tests/test_a.py::test_x[one]"])[1] == []
