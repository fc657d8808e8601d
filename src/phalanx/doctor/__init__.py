"""``phalanx doctor``'s analysis: measured phases, noise scale, predictions, recommendations, report, trace."""
