"""Across ranks: collectives matched and the clock offsets they give, p2p messages matched and the pipelines
they form, bandwidth against the links, and the source each rank's pipeline bubble is measured from."""
