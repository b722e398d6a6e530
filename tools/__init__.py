"""The course's own tooling: executing notebooks, solving labs, reading the syllabus."""
