import pytest

from dpu_wire import names


@pytest.mark.parametrize(
    ("value", "collections", "ids"),
    [
        ("volumes/v1", ("volumes",), ("v1",)),
        ("sessions/s-1/jobs/42", ("sessions", "jobs"), ("s-1", "42")),
        ("volumes/" + "a" * 63, ("volumes",), ("a" * 63,)),
    ],
)
def test_parse_name_accepts(value, collections, ids):
    assert names.parse_name(value, *collections) == ids


@pytest.mark.parametrize(
    ("value", "collections", "reason"),
    [
        ("", ("volumes",), "empty"),
        ("volumes/", ("volumes",), "empty"),
        ("volumes/" + "a" * 64, ("volumes",), "at most 63"),
        ("x" * 300, ("volumes",), "at most 256"),
        ("volume/v1", ("volumes",), "does not match"),
        ("volumes/v1/extra", ("volumes",), "does not match"),
        ("volumes/V1", ("volumes",), "lowercase"),
        ("volumes/-v", ("volumes",), "lowercase"),
        ("volumes/v_1", ("volumes",), "lowercase"),
        ("sessions/s1/jobs", ("sessions", "jobs"), "does not match"),
    ],
)
def test_parse_name_rejects_with_reason(value, collections, reason):
    with pytest.raises(names.InvalidNameError, match=reason):
        names.parse_name(value, *collections)


def test_format_name_round_trips():
    name = names.format_name("sessions", "s1", "regions", "in")
    assert names.parse_name(name, "sessions", "regions") == ("s1", "in")


@pytest.mark.parametrize(("value", "number"), [("0", 0), ("7", 7), (str(names.U64_MAX), 2**64 - 1)])
def test_parse_number_takes_canonical_decimal(value, number):
    assert names.parse_number(value) == number


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("01", "canonical"),
        ("00", "canonical"),
        ("+1", "canonical"),
        ("-1", "canonical"),
        (" 1", "canonical"),
        ("1 ", "canonical"),
        ("1_0", "canonical"),
        ("\u0661", "canonical"),  # an Arabic-Indic digit: str.isdigit() takes it
        ("", "canonical"),
        (str(2**64), "larger than"),
        ("9" * 63, "canonical"),
    ],
)
def test_parse_number_refuses_other_spellings(value, reason):
    with pytest.raises(names.InvalidNameError, match=reason):
        names.parse_number(value, "job id")
