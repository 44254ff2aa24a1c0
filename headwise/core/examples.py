"""Example inputs that the library and the command line share (plain data, no torch: `headwise --help`
builds every subcommand's parser from it without importing the library)."""

# `headwise.analysis.analyze`'s text whose attention patterns are drawn, and `headwise analyze --text`'s default:
# "bank" twice, in two senses, so the heads that tell them apart show.
ANALYSIS_TEXT = "The bank approved the loan after the river bank flooded."
