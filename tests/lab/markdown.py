"""Reading the reports' markdown back, for the tests of the study's report."""


def table_rows(markdown, first_header):
    """The rows of the markdown table whose first header cell is ``first_header``."""
    lines = markdown.splitlines()
    start = next(
        i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |")
    )
    header = [c.strip() for c in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (c.strip() for c in line.strip("|").split("|")))))
    return rows
