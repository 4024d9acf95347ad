# --save-state and --resume: a run stopped after step 6 on one mesh and resumed on another ends
# where the uninterrupted one-rank run ends (DESIGN.md invariant 3; the printed 4 decimals may
# differ in the last place from reassociation). Every run drops (hidden and attention dropout
# 0.1): the masks follow the global position and the step, not the mesh, so the resumed run
# draws the uninterrupted run's masks. TRAIN is gpt2_train or bert_train, DIR a scratch directory.
set(common --demo --steps 12 --warmup 2 --log-every 100 --dropout 0.1 --attention-dropout 0.1)
include(${CMAKE_CURRENT_LIST_DIR}/train_script.cmake)

file(MAKE_DIRECTORY ${DIR})
set(state ${DIR}/resume_state.bin)
file(REMOVE ${state})
train(whole)
train(first --stop-after 6 --save-state ${state} --dp 2 --tp 2 --zero 1 --threads 2)
if(NOT first MATCHES "over steps 1\\.\\.6 of 12" OR NOT first MATCHES "saved training state .* after step 6")
  message(FATAL_ERROR "the first half should stop after step 6 and save:\n${first}")
endif()
train(second --resume ${state} --pp 2 --threads 2)
if(NOT second MATCHES "resumed from .* after step 6" OR NOT second MATCHES "over steps 7\\.\\.12 of 12")
  message(FATAL_ERROR "the second half should resume after step 6:\n${second}")
endif()
expect_resumed_loss("${whole}" "${second}" "stopped on dp2 x tp2 and resumed on pp2")

# A file of another kind is refused before step 1, and --steps must go past the saved steps.
execute_process(COMMAND ${TRAIN} --demo --steps 6 --warmup 2 --resume ${state}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "steps done: got 6")
  message(FATAL_ERROR "resuming past --steps must be refused, got (${rc}):\n${out}\n${err}")
endif()
file(WRITE ${DIR}/not_a_state.bin "hello")
execute_process(COMMAND ${TRAIN} ${common} --resume ${DIR}/not_a_state.bin
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "loom: training state" OR out MATCHES "step +1 ")
  message(FATAL_ERROR "a bad training state must be refused before step 1, got (${rc}):\n${out}\n${err}")
endif()
