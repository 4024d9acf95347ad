# A run whose learning rate makes the loss NaN stops at that step on every rank with loom's
# message, leaving the training state it saved the step before; with --no-stop-on-non-finite the
# same run goes on to its end, NaN and all.
# TRAIN is gpt2_train or bert_train, DIR a scratch directory.
set(diverging --demo --steps 12 --warmup 0 --lr 1e4 --log-every 1 --dp 2 --zero 1 --threads 2)
file(MAKE_DIRECTORY ${DIR})
set(state ${DIR}/non_finite_state.bin)
file(REMOVE ${state})

execute_process(COMMAND ${TRAIN} ${diverging} --save-state ${state} --save-every 1
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0)
  message(FATAL_ERROR "a run at --lr 1e4 should stop where its loss is no longer finite:\n${out}\n${err}")
endif()
if(NOT err MATCHES "loom: trainer step ([0-9]+): (loss|gradient norm): got -?(nan|inf); must be finite")
  message(FATAL_ERROR "no message naming the step and the value (${rc}):\n${out}\n${err}")
endif()
set(bad ${CMAKE_MATCH_1})
math(EXPR good "${bad} - 1")
if(good LESS 1)
  message(FATAL_ERROR "the loss should be finite at step 1 (it is the initial model's):\n${out}\n${err}")
endif()
if(NOT err MATCHES "the update was not applied: the parameters and optimizer state are those after step ${good}")
  message(FATAL_ERROR "the message should say what was kept:\n${err}")
endif()
if(out MATCHES "step +${bad} \\|" OR out MATCHES "loss -?nan")
  message(FATAL_ERROR "step ${bad} should print nothing, and no NaN loss should be printed:\n${out}")
endif()
if(NOT out MATCHES "saved training state [^\n]* after step ${good}")
  message(FATAL_ERROR "the state of step ${good} should have been saved:\n${out}")
endif()

# The state left behind is exactly step ${good}'s: resumed, it is refused at step ${bad} again with
# the same values (these weights are what made the loss NaN; a user goes back further, or lowers
# the learning rate before the blow-up).
string(REGEX MATCH "loom: trainer step [^\n]*" refusal "${err}")
execute_process(COMMAND ${TRAIN} ${diverging} --resume ${state}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(FIND "${err}" "${refusal}" at)
if(rc EQUAL 0 OR at EQUAL -1 OR NOT out MATCHES "resumed from [^\n]* after step ${good}")
  message(FATAL_ERROR "resumed after step ${good}, step ${bad} should be refused as before (${rc}):\n${refusal}\n${out}\n${err}")
endif()

# Without the check the update is applied and the run trains on NaN to its last step.
execute_process(COMMAND ${TRAIN} ${diverging} --no-stop-on-non-finite
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "step +${bad} \\|[^\n]*(nan|inf)")
  message(FATAL_ERROR "--no-stop-on-non-finite should apply step ${bad} and go on (${rc}):\n${out}\n${err}")
endif()
message(STATUS "stopped at step ${bad}, and again after resuming from step ${good}")
