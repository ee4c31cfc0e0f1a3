"""`python -m miles_dashboard` = the `miles-dashboard` command."""

from miles_dashboard.cli import main

main()
